"""Matmuls over weights kept as a GGUF file keeps them: integer codes with a scale per block.

``BlockCodes`` (file data: it lives with the GGUF code reader, ``engine/loading/gguf_codes.py``) is
one weight matrix in that form, ``w[r, i] = scale[r, i // block] * codes[r, i]
- minv[r, i // block]``, each value exactly what gguf's dequantizer gives for it
(``engine/loading/gguf_codes.py`` builds them from the file's blocks). ``BlockDot`` multiplies a
few fp32 rows by one or more of them side by side, through ``csrc/blockdot.c``: a decode step of a
quantized model then streams a fraction of the bytes of its fp32 weights (Gemma 3 270M: the Q8_0
head is 170 MiB of codes and fp16 scales where its fp32 copy is 640 MiB). The input rows are
rounded to int16 per block of 32 (``csrc/lblocks.c``: dx_b = max|x_b| / 32767, q = round(x / dx_b))
and the codes multiply them in integers, so a product equals ``F.linear`` on the dequantized weights
to within sum_b (dx_b / 2) sum_{i in b} |scale_b code_i| (offsets multiply the unrounded inputs'
sums, exactly) plus fp32 accumulation: 1/65534 of each block's largest input. Every type
streams the file's own bytes, unpacked in registers (issue 42; the layouts in ``BlockCodes``):
SmolLM2's Q4_1 layers read 0.625 bytes a weight, Gemma 3's Q4_K ones 0.5625 (their super-blocks'
6-bit scales unpacked in ``csrc/kblocks.c``), as llama.cpp reads them.

``BlockCodes.weight()`` rebuilds the fp32 matrix (tests hold it equal to the model's parameter);
``BlockCodes.rows(x)`` is the same product through PyTorch, for a machine without the kernel.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from kvviz.engine.loading.gguf_codes import K_BLOCK_BYTES, PACKED_BLOCK_BYTES, QK_K, BlockCodes
from kvviz.fast.rowops import load

MAX_SEGMENTS = 3  # matrices side by side in one call (q, k and v)
# The most rows (batch x tokens) a forward sends through these kernels, by family and thread count;
# more go to the fp32 path (Llama: llama_flat's C row kernel up to its max_c_rows_fp32, then F.linear's
# GEMM; Gemma 3: the readable model's F.linear). The kernel multiplies each block's codes, unpacked
# once, by up to four input rows (csrc/blockdot.c), but its integer products still grow with the rows
# where a GEMM's cost hardly does. A whole forward of m tokens (last_only, as a prefill) on the codes
# over the same forward on the fallback, medians of 9, interleaved, niced on the shared 2-core AMD
# EPYC (docs/benchmarks.md, 2026-11-28 21:41-21:59; two or three runs, each figure one run's):
#   SmolLM2 (Q4_1), 1 thread: m = 12: 0.68-0.78, 16: 0.65-0.96, 20: 0.89-1.03, 24: 0.87-1.12, 32: 1.14-1.42.
#   SmolLM2, 2 threads (fallback: the fp32 C rows): 8: 0.81-0.93, 12: 1.02-1.14, 16: 1.09-1.20.
#   Gemma 3 (Q5_0/Q8_0/Q4_K/Q6_K), 1 thread: 12: 0.79-0.89, 16: 0.93-1.03, 20: 0.99-1.19, 24: 1.09-1.25.
#   Gemma 3, 2 threads (fallback: F.linear): 16: 0.75-0.81, 20: 0.86, 24: 0.97-1.03, 32: 1.02-1.23.
# "More threads" is measured at 2 (this machine's cores).
MAX_CODE_ROWS = {"llama": {1: 16}, "gemma3": {1: 16}}
MAX_CODE_ROWS_MORE_THREADS = {"llama": 8, "gemma3": 20}
BLOCKS = (16, 32)  # the block sizes the kernel reads: Q6_K's scales cover 16 weights, the rest 32


class _Spec(ctypes.Structure):
    """Mirror of ``kv_blocks`` in blockdot.c (its size is checked against the library's)."""

    _fields_ = [("codes", ctypes.c_void_p * MAX_SEGMENTS), ("scale", ctypes.c_void_p * MAX_SEGMENTS),
                ("minv", ctypes.c_void_p * MAX_SEGMENTS), ("bias", ctypes.c_void_p * MAX_SEGMENTS),
                ("n_out", ctypes.c_int * MAX_SEGMENTS),
                ("block", ctypes.c_int * MAX_SEGMENTS), ("bits", ctypes.c_int * MAX_SEGMENTS),
                ("zero", ctypes.c_int * MAX_SEGMENTS), ("half", ctypes.c_int * MAX_SEGMENTS),
                ("kq", ctypes.c_int * MAX_SEGMENTS),
                ("n_seg", ctypes.c_int), ("n_in", ctypes.c_int),
                ("norm_w", ctypes.c_void_p), ("eps", ctypes.c_float), ("glu", ctypes.c_int),
                ("post_w", ctypes.c_void_p), ("post_eps", ctypes.c_float),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("n_q", ctypes.c_int), ("n_k", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("qk_eps", ctypes.c_float)]


def max_code_rows(threads: int, family: str) -> int:
    """The most rows a forward of ``family`` ("llama": ``llama_codes``; "gemma3": ``gemma3_flat``) on
    ``threads`` intra-op threads sends through the block-code kernels (their fallbacks differ)."""
    return MAX_CODE_ROWS[family].get(threads, MAX_CODE_ROWS_MORE_THREADS[family])


def _fn() -> "ctypes._CFuncPtr | None":  # type: ignore[name-defined]
    lib = load()
    if lib is None or lib.kv_blocks_struct_size() != ctypes.sizeof(_Spec) or lib.kv_blocks_max_seg() != MAX_SEGMENTS:
        return None
    fn = lib.kv_block_rows
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return fn


@dataclass(frozen=True)
class BlockDot:
    """``epilogue(RMSNorm(x) @ W^T + b) (+ res)`` for a few fp32 rows, the weights ``BlockCodes`` side
    by side; the input norm, biases, GeGLU or SwiGLU, the output norm and the q/k heads' norms and
    RoPE are optional (``block_dot`` says which)."""

    spec: _Spec
    spec_addr: int
    n_in: int
    n_out: int
    threads: int
    fn: "ctypes._CFuncPtr"  # type: ignore[name-defined]
    keep: tuple[object, ...]  # the codes and tensors the spec points into

    def __call__(self, x: torch.Tensor, res: torch.Tensor | None = None,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: m rows of n_in fp32 values (any shape); res: m x n_out values added last, or None;
        rope: (cos, sin), each (T, head_dim) fp32, row i of x at row i % T (with ``qk_norm``).
        Returns (m, n_out) fp32."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()  # the C side reads raw fp32 rows
        m = x.numel() // self.n_in
        if res is not None and (res.dtype != torch.float32 or not res.is_contiguous() or res.numel() != m * self.n_out):
            raise ValueError(f"res must hold {m} x {self.n_out} contiguous fp32 values")
        cos = sin = None
        period = 1
        if rope is not None:
            cos, sin = (t.float().contiguous() for t in rope)
            if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != self.spec.head_dim or not self.spec.head_dim:
                raise ValueError(f"RoPE tables must be (T, {self.spec.head_dim}) and the call must norm q/k heads")
            period = cos.shape[0]
        y = torch.empty(m, self.n_out, dtype=torch.float32)
        if self.fn(self.spec_addr, x.data_ptr(), m, y.data_ptr(), None if res is None else res.data_ptr(),
                   None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), period,
                   self.threads):
            raise MemoryError(f"blockdot: no memory for {m} rows")
        return y


def _fits(w: BlockCodes) -> bool:
    out, n_in = w.shape
    if w.superblock:  # K super-blocks as stored: whole ones a row, the sub-block ggml gives the type
        return (w.bits in K_BLOCK_BYTES and w.block == (16 if w.bits == 6 else 32) and w.codes.dtype == torch.uint8
                and w.codes.dim() == 2 and w.codes.shape[1] % K_BLOCK_BYTES[w.bits] == 0 and n_in % QK_K == 0
                and w.codes.is_contiguous() and w.scale is None and w.minv is None and w.zero == 0
                and w.codes.device.type == "cpu")
    nb = n_in // w.block if w.block else 0
    if w.bits == 8:
        ok = w.block in BLOCKS and w.codes.dtype == torch.int8 and w.zero == 0
    else:  # packed: blocks of 32, whole blocks a row
        ok = (w.bits in PACKED_BLOCK_BYTES and w.block == 32 and w.codes.dtype == torch.uint8 and 0 <= w.zero < 32
              and w.codes.shape[1] % PACKED_BLOCK_BYTES[w.bits] == 0)
    ok = ok and w.scale is not None and n_in % w.block == 0 and w.codes.is_contiguous() \
        and w.scale.dtype in (torch.float32, torch.float16)
    for t in (w.scale, w.minv):
        if t is not None and w.scale is not None:
            ok = ok and t.dtype == w.scale.dtype and t.is_contiguous() and tuple(t.shape) == (out, nb)
    return ok and all(t is not None and t.device.type == "cpu" for t in (w.codes, w.scale))


def _vec(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                         and tuple(t.shape) == (n,))


def block_dot(ws: Sequence[BlockCodes], threads: int, norm: tuple[torch.Tensor, float] | None = None,
              geglu: bool = False, post: tuple[torch.Tensor, float] | None = None,
              qk_norm: tuple[torch.Tensor | None, torch.Tensor | None, int, int, float] | None = None,
              swiglu: bool = False, biases: Sequence[torch.Tensor | None] | None = None,
              head_dim: int = 0) -> BlockDot | None:
    """A BlockDot over ``ws`` (same input width), or None when the kernel is missing or a weight
    does not fit (another block size, not CPU, not contiguous). ``norm = (w, eps)``: RMSNorm the
    input rows first, scaled by w; ``geglu``: two weights, gate and up, give gelu_tanh(gate) * up;
    ``post = (w, eps)``: RMSNorm each output row, scaled by w (before ``res`` is added);
    ``qk_norm = (q_w, k_w, n_q, n_k, eps)``: RMSNorm each of the first n_q heads by q_w and the next
    n_k by k_w (head_dim = len(q_w)), then RoPE when the call passes tables; q_w = k_w = None with
    ``head_dim``: RoPE alone (Llama). ``swiglu``: silu(gate) * up, as ``geglu``; ``biases``: one
    fp32 (n_out,) vector or None per weight, added to its outputs (Qwen2's q/k/v)."""
    fn = _fn()
    ws = list(ws)
    bs = list(biases) if biases is not None else [None] * len(ws)
    if fn is None or not 1 <= len(ws) <= MAX_SEGMENTS or not all(_fits(w) for w in ws) or len(bs) != len(ws) \
            or (geglu and swiglu) or not all(_vec(b, w.shape[0]) for b, w in zip(bs, ws)):
        return None
    glu = 1 if geglu else (2 if swiglu else 0)
    n_in = ws[0].shape[1]
    if any(w.shape[1] != n_in for w in ws) or (glu and (len(ws) != 2 or ws[0].shape != ws[1].shape)):
        return None
    n_out = ws[0].shape[0] if glu else sum(w.shape[0] for w in ws)
    norm_w, eps = norm if norm is not None else (None, 0.0)
    post_w, post_eps = post if post is not None else (None, 0.0)
    if not (_vec(norm_w, n_in) and _vec(post_w, n_out)):
        return None
    q_w, k_w, n_q, n_k, qk_eps = qk_norm if qk_norm is not None else (None, None, 0, 0, 0.0)
    hd = int(q_w.shape[0]) if q_w is not None else (head_dim if qk_norm is not None else 0)
    if qk_norm is not None and not (_vec(q_w, hd) and _vec(k_w, hd) and (q_w is None) == (k_w is None)
                                    and hd % 2 == 0 and hd > 0 and not glu and (n_q + n_k) * hd <= n_out):
        return None
    pad = [None] * (MAX_SEGMENTS - len(ws))
    ints = [0] * (MAX_SEGMENTS - len(ws))
    spec = _Spec((ctypes.c_void_p * MAX_SEGMENTS)(*[w.codes.data_ptr() for w in ws], *pad),
                 (ctypes.c_void_p * MAX_SEGMENTS)(*[None if w.scale is None else w.scale.data_ptr() for w in ws], *pad),
                 (ctypes.c_void_p * MAX_SEGMENTS)(*[None if w.minv is None else w.minv.data_ptr() for w in ws], *pad),
                 (ctypes.c_void_p * MAX_SEGMENTS)(*[None if b is None else b.data_ptr() for b in bs], *pad),
                 (ctypes.c_int * MAX_SEGMENTS)(*[w.shape[0] for w in ws], *ints),
                 (ctypes.c_int * MAX_SEGMENTS)(*[w.block for w in ws], *ints),
                 (ctypes.c_int * MAX_SEGMENTS)(*[w.bits for w in ws], *ints),
                 (ctypes.c_int * MAX_SEGMENTS)(*[w.zero for w in ws], *ints),
                 (ctypes.c_int * MAX_SEGMENTS)(*[int(w.scale is not None and w.scale.dtype == torch.float16) for w in ws],
                                               *ints),
                 (ctypes.c_int * MAX_SEGMENTS)(*[int(w.superblock) for w in ws], *ints), len(ws), n_in,
                 None if norm_w is None else norm_w.data_ptr(), float(eps), glu,
                 None if post_w is None else post_w.data_ptr(), float(post_eps),
                 None if q_w is None else q_w.data_ptr(), None if k_w is None else k_w.data_ptr(), n_q, n_k, hd,
                 float(qk_eps))
    keep = (*ws, *(t for t in (norm_w, post_w, q_w, k_w, *bs) if t is not None))
    return BlockDot(spec, ctypes.addressof(spec), n_in, n_out, max(1, threads), fn, keep)


Group = tuple[tuple[str, ...], tuple[torch.Tensor, ...]]  # one fused call's parameter names and parameters


class CodedCall:
    """What a family's fused call (``gemma3_flat.Call``, ``llama_codes.Call``) streams: its ``op`` is a
    ``BlockDot`` on block codes, or the fp32 row kernel (``rowops.RowDot``) where the codes no longer match."""

    op: "BlockDot | object"

    @property
    def rotates(self) -> bool:
        """Whether the call norms and rotates the q and k heads itself (q|k|v on block codes)."""
        return isinstance(self.op, BlockDot) and self.op.spec.head_dim > 0

    @property
    def nbytes(self) -> tuple[int, int]:
        """(bytes of block codes, bytes of fp32 weights) the call streams."""
        keep = getattr(self.op, "keep", ())
        if isinstance(self.op, BlockDot):
            return sum(c.nbytes for c in keep if isinstance(c, BlockCodes)), 0
        return 0, sum(t.nbytes for t in keep if isinstance(t, torch.Tensor) and t.dim() == 2)


def step_ops(calls: "list[CodedCall]") -> tuple[BlockDot, ...]:
    """The layers' calls in order for the one-call C step (``fast/rowstep.py``), or () when one of
    them is not on block codes (a weight whose codes no longer match runs the fp32 row kernel)."""
    ops = tuple(c.op for c in calls)
    return ops if all(isinstance(op, BlockDot) for op in ops) else ()  # type: ignore[return-value]


def codes_match(codes: BlockCodes, w: torch.Tensor) -> bool:
    """Whether ``codes`` rebuild ``w`` (the model's parameter): its shape, and its first, middle and
    last rows value for value. A model whose weights changed after loading keeps its fp32 path."""
    if tuple(codes.shape) != tuple(w.shape) or w.dtype != torch.float32:
        return False
    rows = sorted({0, w.shape[0] // 2, w.shape[0] - 1})
    part = replace(codes, codes=codes.codes[rows], scale=None if codes.scale is None else codes.scale[rows],
                   minv=None if codes.minv is None else codes.minv[rows])
    return torch.equal(part.weight(), w.detach()[rows])


def matching_codes(group: Group, codes: Mapping[str, BlockCodes]) -> list[BlockCodes] | None:
    """The group's codes when every one of its weights has codes that rebuild it, else None."""
    names, weights = group
    cs = [codes.get(n) for n in names]
    return cs if all(c is not None and codes_match(c, w) for c, w in zip(cs, weights)) else None  # type: ignore[misc]
