"""One-row fp32 linear layers in C (``csrc/rowops.c``): the matmuls of a CPU decode step.

A decode step of a small model is bound by streaming its weights and by per-op overhead. MKL's
kernels stream a single row's weights well below what the CPU caches deliver, and every PyTorch
op pays for dispatch. ``RowLinear`` does one layer's ``act(LN(x) @ W + b) + res`` in one call:
the LayerNorm before and the bias, GELU and residual after are fused, and the columns are shared
among the intra-op threads. ``docs/performance.md`` has the measurements.

The C file is compiled on first use with the system's C compiler (``$CC``, else ``cc``/``gcc``)
and OpenMP, into a cache folder (``$KVVIZ_CACHE_DIR``, else ``~/.cache/kvviz``), keyed by the
source, the flags, the compiler and the CPU. Loading a file is running its code, so the cache is
trusted only when nobody else can write it: the folder (created 0700) and the library must be
owned by this user and not writable by group or others, the library is opened without following
links, and its sha256 must match the one recorded beside it at build time; the hash is computed on
the very descriptor that ``dlopen`` then loads (``/proc/self/fd``), so no swap can slip in between.
A folder shared with others is refused (``status()`` says why); a mismatched file is rebuilt. Built after ``import torch``, the library binds to
the OpenMP runtime torch already loaded, so the two share one thread pool. No compiler, a
failed build, or ``KVVIZ_ROWOPS=0`` leaves ``load()`` returning None and ``status()`` saying
why; the decode step then keeps its PyTorch path (same maths, tests hold the two allclose).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kvviz.hostinfo import cpu_name

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "rowops.c"  # GPT-2's (in, out) layout
# and nn.Linear's (out, in) layout, for the Llama family, and its whole one-row decode step
SOURCES = (SOURCE, CSRC / "rowdot.c", CSRC / "rowstep.c",
           CSRC / "logits.c",  # the loop's per-step reads of the logits (fast/logits.py)
           CSRC / "blockdot.c", CSRC / "kblocks.c",
           CSRC / "lblocks.c")  # and weights kept as a GGUF file's block codes (fast/blockdot.py)
HEADERS = (CSRC / "rowcommon.h", CSRC / "rowdot.h", CSRC / "kblocks.h", CSRC / "lblocks.h")
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"],
    ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"],  # compilers without -march=native
)
BUILD_TIMEOUT_S = 120


class _Spec(ctypes.Structure):
    """Mirror of ``kv_linear`` in rowops.c (its size is checked against the library's)."""

    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("ln_w", ctypes.c_void_p),
                ("ln_b", ctypes.c_void_p), ("eps", ctypes.c_float), ("n_in", ctypes.c_int),
                ("n_out", ctypes.c_int), ("gelu", ctypes.c_int)]


MAX_SEGMENTS = 3  # weights side by side in one kv_dot call (q, k and v)


class _DotSpec(ctypes.Structure):
    """Mirror of ``kv_dot`` in rowdot.c (its size is checked against the library's)."""

    _fields_ = [("w", ctypes.c_void_p * MAX_SEGMENTS), ("bias", ctypes.c_void_p * MAX_SEGMENTS),
                ("n_out", ctypes.c_int * MAX_SEGMENTS), ("n_seg", ctypes.c_int), ("n_in", ctypes.c_int),
                ("bf16", ctypes.c_int), ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("swiglu", ctypes.c_int), ("rope_dims", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class StepSpec(ctypes.Structure):
    """Mirror of ``kv_step`` in rowstep.c (its size is checked against the library's); built by
    ``kvviz.fast.rowstep``."""

    _fields_ = [("ops", ctypes.POINTER(ctypes.c_void_p)), ("kv", ctypes.POINTER(ctypes.c_void_p)),
                ("q_out", ctypes.c_void_p), ("attn_out", ctypes.c_void_p), ("norm_out", ctypes.c_void_p),
                ("n_layer", ctypes.c_int), ("nh", ctypes.c_int), ("nkv", ctypes.c_int),
                ("hs", ctypes.c_int), ("max_len", ctypes.c_int), ("n_embd", ctypes.c_int),
                ("mlp_width", ctypes.c_int), ("kv_bf16", ctypes.c_int), ("blocks", ctypes.c_int),
                ("cos", ctypes.POINTER(ctypes.c_void_p)), ("sin", ctypes.POINTER(ctypes.c_void_p)),
                ("scale", ctypes.c_float), ("layer_len", ctypes.c_void_p)]


_lock = threading.Lock()
_loaded = False
_lib: ctypes.CDLL | None = None
_status = "not loaded yet"


def cache_dir() -> Path:
    env = os.environ.get("KVVIZ_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvviz"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _key(cc: str, flags: list[str], version: str) -> str:
    h = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(flags).encode(), cc.encode(), version.encode(),
                 cpu_name().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _private_folder_problem(folder: Path) -> str:
    """'' when only this user can write ``folder``; else why kvviz will not load code from it."""
    try:
        st = os.stat(folder)
    except OSError as e:
        return f"cannot inspect the build folder {folder} ({e.strerror or e})"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return (f"the build folder {folder} belongs to another user; kvviz loads compiled code only from "
                "a folder of its own (set KVVIZ_CACHE_DIR)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"the build folder {folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"kvviz loads compiled code only from a private folder (chmod 700 {folder}, or set KVVIZ_CACHE_DIR)")
    return ""


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


def _digest_path(lib: Path) -> Path:
    return lib.with_suffix(".sha256")


def _record_digest(lib: Path) -> None:
    """Write the built library's sha256 beside it (renamed in, like the library)."""
    fd = os.open(lib, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        digest = _sha256_fd(fd)
    finally:
        os.close(fd)
    fd, tmp = tempfile.mkstemp(suffix=".sha256", dir=lib.parent)  # concurrent builders never collide
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(digest + "\n")
    os.replace(tmp, _digest_path(lib))


def _build(cc: str) -> tuple[Path | None, str]:
    """Compile (or find the cached build of) rowops.c: (path, '') or (None, why not)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {cc!r} did not run ({e})"
    folder = cache_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        return None, f"cannot create the build folder {folder} ({e.strerror or e}); set KVVIZ_CACHE_DIR"
    why = _private_folder_problem(folder)
    if why:
        return None, why
    errors = []
    for flags in FLAG_SETS:
        out = folder / f"rowops-{_key(cc, flags, version)}.so"
        if out.exists() and _digest_path(out).exists():
            return out, ""
        tmp = None
        try:
            # Build to a temporary name, then rename: concurrent processes never load half a file.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
            r = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                               timeout=BUILD_TIMEOUT_S)
            if r.returncode == 0:
                os.replace(tmp, out)
                _record_digest(out)
                return out, ""
            errors.append(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
        finally:
            if tmp is not None and os.path.exists(tmp):  # a failed or timed-out build leaves nothing
                os.unlink(tmp)
    return None, f"building {', '.join(f.name for f in SOURCES)} with {cc} failed: {'; '.join(errors)}"


def _open(path: Path) -> tuple[ctypes.CDLL | None, str]:
    """dlopen ``path`` after checking who can write it and that its bytes are the ones built.

    The checks and the hash run on one descriptor, opened without following links, and that same
    descriptor is what is loaded (through /proc/self/fd where it exists).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        return None, f"loading {path} failed: {e.strerror or e}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file"
        if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None, f"{path} is writable by, or belongs to, another user; not loading it"
        try:
            want = _digest_path(path).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            want = ""
        if _sha256_fd(fd) != want:
            return None, f"{path} does not match the sha256 recorded when it was built"
        proc = Path(f"/proc/self/fd/{fd}")
        return ctypes.CDLL(str(proc) if proc.exists() else str(path)), ""
    except OSError as e:
        return None, f"loading {path} failed: {e}"
    finally:
        os.close(fd)


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("KVVIZ_ROWOPS", "1") == "0":
        return None, "off (KVVIZ_ROWOPS=0)"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler found (set CC, or install gcc)"
    path, why = _build(cc)
    if path is None:
        return None, why
    lib, why = _open(path)
    if lib is None:  # a damaged or tampered cached build (never a half-written one: builds are renamed in)
        path.unlink(missing_ok=True)
        _digest_path(path).unlink(missing_ok=True)
        path, _ = _build(cc)  # rebuild once; a second failure is reported as the first
        lib = None if path is None else _open(path)[0]
        if lib is None:
            return None, why
    if (lib.kv_struct_size(), lib.kv_dot_struct_size(), lib.kv_dot_max_seg(), lib.kv_step_struct_size()) != (
            ctypes.sizeof(_Spec), ctypes.sizeof(_DotSpec), MAX_SEGMENTS, ctypes.sizeof(StepSpec)):
        return None, f"{path} does not match this kvviz (struct size)"
    fn = lib.kv_linear_row
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn = lib.kv_dot_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_int]
    fn = lib.kv_llama_step
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    fn = lib.kv_all_finite
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    fn = lib.kv_argmax
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    fn = lib.kv_top_probs
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib, f"built with {Path(cc).name} ({path.name})"


def load() -> ctypes.CDLL | None:
    """The library, built on the first call; None when it cannot be had (``status()`` says why)."""
    global _loaded, _lib, _status
    if not _loaded:
        with _lock:
            if not _loaded:
                _lib, _status = _load()
                _loaded = True
    return _lib


def status() -> str:
    """'built with cc (...)', or why the decode step runs on PyTorch's kernels instead."""
    load()
    return _status


def max_ln_width() -> int:
    lib = load()
    return 0 if lib is None else lib.kv_max_ln()


@dataclass(frozen=True)
class RowLinear:
    """``act(LN(x) @ w + bias) (+ res)`` for one fp32 row on the CPU, through rowops.c.

    Reads the parameters in place through raw pointers, so it sees in-place updates, and holds
    references to them so the pointers stay valid. Build it with ``row_linear``.
    """

    spec: _Spec
    spec_addr: int
    n_out: int
    threads: int
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    keep: tuple[torch.Tensor, ...]  # the tensors the spec points into

    def __call__(self, x: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
        """x: n_in contiguous floats (any shape); res: n_out floats or None. Returns (n_out,)."""
        y = torch.empty(self.n_out, dtype=torch.float32)
        self.fn(self.spec_addr, x.data_ptr(), None if res is None else res.data_ptr(), y.data_ptr(), self.threads)
        return y


def _ok(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                         and t.numel() == n)


def row_linear(w: torch.Tensor, bias: torch.Tensor | None, threads: int,
               ln: tuple[torch.Tensor, torch.Tensor | None, float] | None = None,
               gelu: bool = False) -> RowLinear | None:
    """A RowLinear for w (in, out), or None when the library is missing or a tensor does not fit
    (not CPU, not fp32, not contiguous, or a LayerNorm wider than the C side's buffer)."""
    lib = load()
    if lib is None or w.dim() != 2:
        return None
    n_in, n_out = w.shape
    ln_w, ln_b, eps = ln if ln is not None else (None, None, 0.0)
    if not (_ok(w, n_in * n_out) and _ok(bias, n_out) and _ok(ln_w, n_in) and _ok(ln_b, n_in)):
        return None
    if ln_w is not None and n_in > lib.kv_max_ln():
        return None
    keep = tuple(t.detach() for t in (w, bias, ln_w, ln_b) if t is not None)

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    spec = _Spec(ptr(w), ptr(bias), ptr(ln_w), ptr(ln_b), float(eps), n_in, n_out, int(gelu))
    return RowLinear(spec, ctypes.addressof(spec), n_out, max(1, threads), lib.kv_linear_row, keep)


@dataclass(frozen=True)
class RowDot:
    """``epilogue(RMSNorm(x) @ W^T + b) (+ res)`` for a few fp32 rows on the CPU, through rowdot.c,
    with W in nn.Linear's (out, in) layout, fp32 or bf16 (widened as it is read).

    The epilogue is the bias, then SwiGLU (``silu(gate) * up`` of two weights read in one pass)
    or nothing, then the residual; RoPE rotates the first ``rope_dims`` outputs of each row at its
    position. Reads the parameters in place through raw pointers and holds references to them.
    Build it with ``row_dot``.
    """

    spec: _DotSpec
    spec_addr: int
    n_in: int
    n_out: int  # outputs per row: the segments side by side, or SwiGLU's n_out[0]
    threads: int
    rope: bool
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    keep: tuple[torch.Tensor, ...]  # the tensors the spec points into

    def __call__(self, x: torch.Tensor, res: torch.Tensor | None = None,
                 pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: m rows of n_in contiguous fp32 values (any shape); res: m x n_out values or None;
        pos: int64 positions, row i at pos[i % len(pos)] (only with RoPE). Returns (m, n_out)."""
        m = x.numel() // self.n_in
        y = torch.empty(m, self.n_out, dtype=torch.float32)
        if self.rope:
            assert pos is not None and pos.dtype == torch.int64 and pos.is_contiguous()
            p, period = pos.data_ptr(), pos.numel()
        else:
            p, period = None, 1
        if self.fn(self.spec_addr, x.data_ptr(), m, None if res is None else res.data_ptr(), y.data_ptr(),
                   self.threads, p, period):
            raise MemoryError(f"rowdot: no memory for {m} normalized rows")
        return y


def _fp32(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                         and t.dim() == 1 and t.numel() == n)


def row_dot(ws: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None, threads: int,
            norm: tuple[torch.Tensor, float] | None = None, swiglu: bool = False,
            rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> RowDot | None:
    """A RowDot for the weights ``ws`` (each (out, in), side by side in the output; gate and up
    with ``swiglu``), or None when the library is missing or a tensor does not fit.

    The weights must be contiguous CPU fp32 or bf16 (all alike); biases, the RMSNorm weight
    (``norm = (w, eps)``) and the RoPE tables (``rope = (cos, sin, dims)``, each table
    (positions, head_dim)) contiguous CPU fp32.
    """
    lib = load()
    ws = list(ws)
    bs = list(biases) if biases is not None else [None] * len(ws)
    if lib is None or not 1 <= len(ws) <= MAX_SEGMENTS or len(bs) != len(ws) or (swiglu and len(ws) != 2):
        return None
    dtypes = {w.dtype for w in ws}
    if not all(w.dim() == 2 and w.device.type == "cpu" and w.is_contiguous() for w in ws) or len(dtypes) != 1 \
            or dtypes.pop() not in (torch.float32, torch.bfloat16):
        return None
    n_in = ws[0].shape[1]
    outs = [w.shape[0] for w in ws]
    if any(w.shape[1] != n_in for w in ws) or not all(_fp32(b, n) for b, n in zip(bs, outs)):
        return None
    if swiglu and outs[0] != outs[1]:
        return None
    norm_w, eps = norm if norm is not None else (None, 0.0)
    if not _fp32(norm_w, n_in):
        return None
    n_total = outs[0] if swiglu else sum(outs)
    cos = sin = None
    dims = hd = 0
    if rope is not None:
        cos, sin, dims = rope
        hd = cos.shape[-1] if cos.dim() == 2 else 0
        if not (hd and hd % 2 == 0 and sin.shape == cos.shape and _fp32(cos.view(-1), cos.numel())
                and _fp32(sin.view(-1), sin.numel()) and 0 < dims <= n_total and dims % hd == 0 and not swiglu):
            return None
    keep = tuple(t.detach() for t in (*ws, *bs, norm_w, cos, sin) if t is not None)

    def ptrs(ts: Sequence[torch.Tensor | None]) -> list[int | None]:
        return [None if t is None else t.data_ptr() for t in ts] + [None] * (MAX_SEGMENTS - len(ts))

    spec = _DotSpec((ctypes.c_void_p * MAX_SEGMENTS)(*ptrs(ws)), (ctypes.c_void_p * MAX_SEGMENTS)(*ptrs(bs)),
                    (ctypes.c_int * MAX_SEGMENTS)(*(outs + [0] * (MAX_SEGMENTS - len(outs)))), len(ws), n_in,
                    int(ws[0].dtype == torch.bfloat16), None if norm_w is None else norm_w.data_ptr(), float(eps),
                    int(swiglu), dims, hd, None if cos is None else cos.data_ptr(),
                    None if sin is None else sin.data_ptr())
    return RowDot(spec, ctypes.addressof(spec), n_in, n_total, max(1, threads), rope is not None,
                  lib.kv_dot_rows, keep)
