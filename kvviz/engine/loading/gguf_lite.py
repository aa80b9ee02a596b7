"""kvviz's one way to open a GGUF file, every family: the header checked, then the metadata
decoded once and each tensor a view of a memory map.

``gguf.GGUFReader`` builds a few numpy views for every item of every metadata array. Gemma 3's
vocabulary is three arrays of 262,144 items (pieces, scores, types): about 800,000 items parsed
one by one, 10 to 35 s on a 2-core box before a single weight is read (SmolLM2's 49k: ~4 s).
Here, after ``gguf_checks.scan_header`` has checked every length against the file's size, the
metadata is read with ``struct`` (an array of numbers is one ``np.frombuffer``), and each tensor
is a read-only view of a memory map: raw bytes shaped (rows, bytes per row), what
``gguf.quants.dequantize`` takes for every type. Nothing is copied until a tensor is dequantized.

``read_gguf`` is the only place a GGUF file is opened (model loaders, the tokenizer, the UI's
calculator): whoever reads one gets the header checks, and the model loader hands the decoded
metadata on to the tokenizer instead of decoding it again.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvviz.engine.loading.gguf_checks import scan_header
from kvviz.errors import KVVizError

# GGUF value types: (struct format, numpy dtype) of the scalar ones; 8 is a string, 9 an array.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class LiteTensor:
    """One tensor: its name, type, torch-order shape and raw bytes (rows, bytes per row)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (out, in) for a matrix (ggml lists the innermost first)
    data: np.ndarray  # uint8 view of the memory map


@dataclass(frozen=True)
class LiteGGUF:
    path: Path
    metadata: dict[str, Any]  # key -> int, float, bool, str, list[str] or a numpy array of numbers
    tensors: tuple[LiteTensor, ...]
    architecture: str | None = None  # general.architecture, as the header walk read it

    def tokenizer_metadata(self) -> dict[str, Any]:
        """Every ``tokenizer.*`` key (vocabulary, merges, types, special ids, chat template) as
        plain Python values: numeric arrays become lists. Nothing is decoded again."""
        return {k: v.tolist() if isinstance(v, np.ndarray) else v
                for k, v in self.metadata.items() if k.startswith("tokenizer.")}


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos: self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype in _SCALARS:
                dt = np.dtype(_SCALARS[itype][1])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr
            return [self.value(itype) for _ in range(count)]
        raise KVVizError(f"unknown GGUF value type {vtype}")  # scan_header refused these already


def read_gguf(path: str | Path) -> LiteGGUF:
    """Metadata and tensor views of a GGUF file, after ``scan_header`` has accepted its header
    (KVVizError naming the problem otherwise): the one GGUF opener, whatever the family."""
    path = Path(path)
    scan = scan_header(path)  # every length checked against the file's size, in words
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    c = _Cursor(buf)
    c.pos = 4 + 4 + 8  # magic, version, tensor count
    n_kv = c.scalar("<Q")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in meta:  # which one would count? llama.cpp's reader refuses these too
            raise KVVizError(f"{path.name} is not a readable GGUF file: metadata key {key} appears twice")
        meta[key] = c.value(c.scalar("<I"))
    tensors = []
    names: set[str] = set()
    for t in scan.tensors:
        if t.name in names:
            raise KVVizError(f"{path.name} is not a readable GGUF file: tensor {t.name} appears twice")
        names.add(t.name)
        qtype = GGMLQuantizationType(t.type_id)  # scan_header checked the type is known
        block, type_size = GGML_QUANT_SIZES[qtype]
        row_bytes = t.dims[0] // block * type_size
        rows = 1
        for d in t.dims[1:]:
            rows *= d
        start = scan.data_start + t.offset
        data = mm[start: start + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(LiteTensor(t.name, qtype, tuple(reversed(t.dims)), data))
    return LiteGGUF(path, meta, tuple(tensors), scan.architecture)
