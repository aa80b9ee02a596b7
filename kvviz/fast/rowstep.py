"""A Llama-shaped model's whole one-row decode step in one call into C (``csrc/rowstep.c``).

``fast/llama_flat.py``'s one-row step makes four calls into C per layer and, between them, splits
q|k|v, writes the cache and runs SDPA in PyTorch: tens of microseconds of Python and dispatch per
layer, 30 times a SmolLM2 token, which the weight-streaming floor does not pay. ``LlamaStep``
chains the same four calls (the plan's own specs, so the same weights and fusions) with the cache
write and attention inside C, once per token: SmolLM2 decoded 1.20x faster at 2 threads and 1.07x
at 1 in fp32, 1.14x with bf16 weights (docs/performance.md, "The whole step in C"). The calls are
either the fp32/bf16 row kernel's (``RowDot``) or, for a GGUF's block codes (issue 42), the block
kernel's (``BlockDot``: ``fast/llama_codes.py``, ``fast/gemma3_flat.py``), whose calls take each
layer's RoPE tables and the model's attention scale from the step.
C writes the cache only where the cache itself says: into the buffers ``cache.step_buffers()``
hands out, at the slot ``cache.step_slots(1)`` names, which also counts the bytes as ``update`` does.

It serves the common case only, and says so by returning None from ``step_for``: a
``StaticKVCache`` (exactly that class) of batch 1 on the CPU, without ring layers, in fp32 with
fp32 weights or block codes, or in bf16 with bf16 weights (K/V rounded to bf16 as ``Tensor.to``
rounds, read back widened). Every other cache (concat, paged, quantized, windowed), a mixed dtype,
or a batch keeps the per-layer path, whose maths this equals (tests hold both to the readable model).
"""
from __future__ import annotations

import ctypes
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from kvviz.engine.kvcache.dense import StaticKVCache
from kvviz.fast.blockdot import BlockDot
from kvviz.fast.rowops import RowDot, StepSpec, load

if TYPE_CHECKING:  # pragma: no cover
    from kvviz.engine.generation.capture import ForwardCapture

Ops = tuple[RowDot, ...] | tuple[BlockDot, ...]  # four fused calls a layer, all of one kernel
Rope = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # each layer's (cos, sin) tables, (positions, hs) fp32


class LlamaStep:
    """The C step for one plan and one cache: the specs' and the K/V buffers' addresses, and
    buffers where C leaves what a capture reads: each layer's rotated query, and on request its
    attention weights and the norms of the new K/V (``__call__``'s ``probs`` and ``norms``)."""

    def __init__(self, ops: Ops, cache: StaticKVCache, c: Any, rope: Rope | None = None,
                 scale: float = 0.0) -> None:
        """``c``: the model's config (n_layer, n_head, kv_heads, head_dim, n_embd); ``rope`` and
        ``scale`` (0: 1 / sqrt(head_dim)) for block-code calls, which do not carry tables."""
        lib = load()
        assert lib is not None and c.head_dim is not None and len(ops) == 4 * c.n_layer
        nh, nkv, hs = c.n_head, c.kv_heads, c.head_dim
        addrs = [op.spec_addr for op in ops]
        buffers = cache.step_buffers()
        assert buffers is not None  # step_for builds a step only for buffers a direct writer may write
        self.buffers = buffers  # the cache's own K/V buffers, K0, V0, K1, V1, ...: the order rowstep.c reads
        self.q = torch.empty(c.n_layer, nh * hs, dtype=torch.float32)  # (n_layer, nh hs)
        lens = [t.shape[2] for t in buffers[::2]]  # each layer's rows per head (a ring: its window's)
        max_len = max(lens)
        self._lens = None if len(set(lens)) == 1 else (ctypes.c_int * len(lens))(*lens)
        # Made on the first request (a live run's captures), not per cache: SmolLM2's weights buffer
        # is 8.8 MB at its 8,192 positions, which a run without captures should neither hold nor fill.
        self._probs_shape, self._norms_shape = (c.n_layer, nh, max_len), (c.n_layer, 2, nkv)
        self.probs: torch.Tensor | None = None  # (n_layer, nh, max_len): C's attention weights
        self.norms: torch.Tensor | None = None  # (n_layer, K|V, nkv): the new K/V norms
        self._ops = (ctypes.c_void_p * len(addrs))(*addrs)
        self._kv = (ctypes.c_void_p * len(self.buffers))(*(t.data_ptr() for t in self.buffers))
        blocks = isinstance(ops[0], BlockDot)
        self.rope = rope  # keeps the tables the addresses point at alive
        tables = [None, None] if rope is None else [(ctypes.c_void_p * c.n_layer)(*(t[k].data_ptr() for t in rope))
                                                    for k in (0, 1)]
        self._tables = tables
        vp = ctypes.POINTER(ctypes.c_void_p)
        self.spec = StepSpec(ctypes.cast(self._ops, vp), ctypes.cast(self._kv, vp), self.q.data_ptr(),
                             None, None, c.n_layer, nh, nkv, hs, max_len, c.n_embd,
                             ops[2].n_out, int(cache.dtype == torch.bfloat16), int(blocks),
                             None if tables[0] is None else ctypes.cast(tables[0], vp),
                             None if tables[1] is None else ctypes.cast(tables[1], vp), float(scale),
                             None if self._lens is None else ctypes.addressof(self._lens))
        self.n_head, self.head_dim = nh, hs
        self._addr = ctypes.addressof(self.spec)
        self.ops = ops  # keeps the specs the addresses point at alive
        self.threads = ops[0].threads
        self._fn = lib.kv_llama_step

    def matches(self, ops: Ops, cache: StaticKVCache, rope: Rope | None = None) -> bool:
        """Still the plan, the tables and the buffers it was built for (a reorder to a new batch
        replaces the buffers; a longer run, Gemma's tables)."""
        bufs = cache.step_buffers()
        return ops is self.ops and rope is self.rope and bufs is not None \
            and all(a is b for a, b in zip(self.buffers, bufs))

    def __call__(self, x: torch.Tensor, pos: int, slot: int, probs: bool = False, norms: bool = False) -> None:
        """x: the embedded token, (C,) contiguous fp32, replaced in place by the last layer's
        residual stream. RoPE rotates at ``pos``; K and V are written at ``slot`` of the cache's
        ``step_buffers``, the slot its ``step_slots`` named (which counted those bytes).

        ``probs``: leave every layer's attention weights in ``self.probs[:, :, :slot + 1]``;
        ``norms``: the L2 norms of the K and V written at ``slot`` in ``self.norms`` (as stored:
        rounded, in a bf16 cache). Both are rewritten by the next call."""
        # C writes every entry that is read back (rows 0..slot of each head): no fill needed.
        if probs and self.probs is None:
            self.probs = torch.empty(self._probs_shape, dtype=torch.float32)
        if norms and self.norms is None:
            self.norms = torch.empty(self._norms_shape, dtype=torch.float32)
        self.spec.attn_out = self.probs.data_ptr() if probs and self.probs is not None else None
        self.spec.norm_out = self.norms.data_ptr() if norms and self.norms is not None else None
        if self._fn(self._addr, x.data_ptr(), pos, slot, self.threads):
            raise MemoryError("rowstep: no memory for the attention scores or a fused call's normalized rows")

    def decode(self, x: torch.Tensor, pos: int, cache: StaticKVCache, capture: "ForwardCapture | None") -> None:
        """One decode step of the token embedded in ``x`` ((C,) fp32, replaced by the last layer's
        residual stream) at position ``pos``: the cache names the slot and counts it, and a
        capture gets what the per-layer path would give it."""
        slot = cache.step_slots(1)  # the cache names the slot C writes this position's K/V to, and counts them
        # A capture's attention weights and new K/V norms come out of C, which computes the one
        # query row's weights anyway (the capture would redo 30 small matmuls in PyTorch).
        want_p, want_n = (capture.want_attn, capture.want_norms) if capture is not None else (False, False)
        self(x, pos, slot, want_p, want_n)
        if capture is None:
            return
        c_attn, c_norms = want_p and self.probs is not None, want_n and self.norms is not None
        if c_attn:
            capture.probs = self.probs[:, :, :slot + 1].clone()  # (n_layer, nh, S): rewritten next step
        if c_norms:
            capture.new_norms = self.norms.clone()  # (n_layer, 2, nkv)
        # C gave the weights and norms asked for: ``record`` (the consumer that asks) then reads
        # only the raw K/V layer's references, not 30 query clones and 60 views a step.
        from_c = (want_p or want_n) and (c_attn or not want_p) and (c_norms or not want_n)
        for i in (capture.layers & {capture.kv_layer}) if from_c else capture.layers:
            if not from_c:  # what the per-layer path captures: post-RoPE q, the cache's K/V
                capture.q_last[i] = self.q[i].view(1, self.n_head, 1, self.head_dim).clone()  # rewritten next step
            k, v = self.buffers[2 * i], self.buffers[2 * i + 1]  # the cache's layer-i buffers
            capture.k[i], capture.v[i] = k.narrow(2, 0, slot + 1), v.narrow(2, 0, slot + 1)


_steps: "weakref.WeakKeyDictionary[StaticKVCache, LlamaStep]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()  # the app's sessions decode on several threads, each with its own cache


def step_for(ops: Ops, cache: object, c: Any, rope: Rope | None = None, scale: float = 0.0) -> LlamaStep | None:
    """The C step for a plan's per-layer calls (four per layer: ``RowPlan.step_ops``, or a block-code
    plan's calls with each layer's RoPE tables and the attention scale) and this cache, built once
    per cache, or None where it does not apply."""
    if not ops or type(cache) is not StaticKVCache or cache.batch != 1 or cache.device.type != "cpu" \
            or load() is None:
        return None
    if isinstance(ops[0], BlockDot):  # block codes: fp32 activations and cache, tables for every layer
        if not all(isinstance(op, BlockDot) for op in ops) or cache.dtype != torch.float32 or rope is None \
                or len(rope) != c.n_layer:
            return None
    # fp32 weights with an fp32 cache, bf16 weights (widened in C) with a bf16 cache
    elif cache.dtype != (torch.bfloat16 if ops[0].spec.bf16 else torch.float32):
        return None
    step = _steps.get(cache)
    if step is None or not step.matches(ops, cache, rope):
        # checked once per cache buffers, not per token: the same tensors stay contiguous
        bufs = cache.step_buffers()
        if bufs is None or not all(t.is_contiguous() for t in bufs):
            return None
        with _lock:
            step = _steps[cache] = LlamaStep(ops, cache, c, rope, scale)
    return step
