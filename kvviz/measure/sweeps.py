"""The measurement harness behind the race, prefill/decode and batching views.

Every measurement is a generator, so the UI can stream it, draw a progress bar, and stop it
(a stopped sweep keeps the samples it already yielded). Runs go one after another, never
concurrently, and all timings come from ``iter_generate`` (forward + sampling, synchronized on
CUDA) or from this module's own synchronized clock (the roofline probe).

Nothing here knows about Streamlit; the analysis of what is measured lives in ``measure.stats``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import torch

from kvviz.units import kv_bytes_per_token
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.generation.events import Run, StepEvent
from kvviz.engine.generation.flops import forward_bytes, forward_flops
from kvviz.engine.api import iter_generate
from kvviz.engine.core.loop import GenerationStream
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.measure.stats import MODES, Sample

SWEEP_NS = (8, 16, 32, 64, 128, 256, 512)  # new tokens for the total-time sweep
BATCH_SIZES = (1, 2, 4, 8, 16)
SHORT_QUESTION = "What does RAM stand for in a computer?"  # SmolLM2 answers it right (a KV cache it does not know)
# The "long pasted document": cycled to fill the context, so any tokenizer gets real text.
DOCUMENT = (
    "A transformer generates one token at a time. Each new token attends to every token before it, "
    "so without a cache the model would recompute the keys and values of the whole sequence at every "
    "step. The KV cache keeps those keys and values, layer by layer, so each step only computes the "
    "newest token and reads the rest from memory. Reading is cheap compared with recomputing, but it "
    "is not free: the cache grows with the context and the batch, and decoding becomes a question of "
    "memory bandwidth rather than arithmetic. "
)
# Distinct texts for "different prompts" batches, cut to one common token length. Their first
# letters all differ, so even rows cut to a single byte are different prompts.
DIFFERENT_TEXTS = (
    "All happy families are alike; each unhappy family is unhappy in its own way. ",
    "Buck did not read the newspapers, or he would have known that trouble was brewing. ",
    "Call me Ishmael. Some years ago, never mind how long precisely, ",
    "Dorothy lived in the midst of the great Kansas prairies, ",
    "Every morning the lighthouse keeper counted the boats in the bay. ",
    "Four score and seven years ago our fathers brought forth on this continent ",
    "Gaul is divided into three parts, one of which the Belgae inhabit. ",
    "Happy the man, whose wish and care a few paternal acres bound. ",
    "It was the best of times, it was the worst of times, ",
    "Last night I dreamt I went to Manderley again. ",
    "Many years later, as he faced the firing squad, ",
    "Now is the winter of our discontent made glorious summer. ",
    "Once upon a time, in a kingdom by the sea, ",
    "Shall I compare thee to a summer's day? Thou art more lovely. ",
    "To be, or not to be, that is the question: ",
    "We hold these truths to be self-evident, that all men are created equal. ",
)


@dataclass(frozen=True)
class Request:
    """What every run of a comparison shares: prompt rows, length, sampling and backend; each mode
    ("static", "concat", "none") adds its own ``CacheSpec``."""

    prompt_ids: tuple[tuple[int, ...], ...]  # (B, N): equal-length rows, B >= 1
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()  # greedy
    prompt: str | None = None  # the text, when the rows came from one (kept for the Run)
    backend: str = "fast"  # every mode through the accelerator ("fast"), or every mode through the readable model
    # Timing generates the length it promises: an instruct model's EOS would end a run after a few
    # tokens (and leave a decode sweep short of its context), so EOS is an ordinary token here.
    ignore_eos: bool = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids[0])

    @property
    def batch_size(self) -> int:
        return len(self.prompt_ids)

    def with_(self, **changes: object) -> "Request":
        return replace(self, **changes)  # type: ignore[arg-type]

    def kwargs(self, mode: str) -> dict[str, object]:
        """iter_generate's arguments after the model for one mode: "static", "concat" or "none"."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        prompt: object
        if self.prompt is not None and self.batch_size == 1:
            prompt = self.prompt
        else:
            rows = [list(r) for r in self.prompt_ids]
            prompt = rows if len(rows) > 1 else rows[0]
        return {"prompt": prompt, "max_new_tokens": self.max_new_tokens,
                "sampling": replace(self.sampling, ignore_eos=self.ignore_eos),
                "cache": CacheSpec(use_cache=mode != "none", kind="static" if mode == "none" else mode),
                "backend": self.backend}


def backend_name(fast: bool) -> str:
    """The API's name for the sweeps' fast/readable switch."""
    return "fast" if fast else "readable"


def request_from_text(model: LoadedModel, prompt: str, max_new_tokens: int,
                      sampling: SamplingParams = SamplingParams()) -> Request:
    ids = tuple(model.tokenizer.encode(prompt))
    return Request(prompt_ids=(ids,), max_new_tokens=max_new_tokens, sampling=sampling, prompt=prompt)


def start(model: LoadedModel, req: Request, mode: str) -> GenerationStream:
    return iter_generate(model, **req.kwargs(mode))  # type: ignore[arg-type,return-value]


def run_once(model: LoadedModel, req: Request, mode: str) -> Run:
    stream = start(model, req, mode)
    for _ in stream:
        pass
    return stream.run


def warmup(model: LoadedModel, modes: Sequence[str] = MODES, tokens: int = 3) -> None:
    """A few throwaway steps per mode: the first forward pays for allocator and thread-pool setup."""
    n = min(8, model.config.block_size - tokens)
    req = Request(prompt_ids=(tuple([0] * n),), max_new_tokens=tokens)
    for mode in modes:
        run_once(model, req, mode)


# --- the race -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RaceTick:
    """One step of one mode; ``event`` is None once that mode has finished."""

    mode: str
    event: StepEvent | None
    stream: GenerationStream

    @property
    def run(self) -> Run:
        return self.stream.run


def iter_race(model: LoadedModel, req: Request, modes: Sequence[str] = MODES,
              warm: bool = True) -> Iterator[RaceTick]:
    """Run each mode to the end, one after another, with the same request; stream every step."""
    if warm:
        warmup(model, modes)
    for mode in modes:
        stream = start(model, req, mode)
        for ev in stream:
            yield RaceTick(mode, ev, stream)
        yield RaceTick(mode, None, stream)


@dataclass(frozen=True)
class Agreement:
    identical: bool  # every compared step matched, on every batch row
    compared: int  # steps compared (the shortest run's length)
    lengths: dict[str, int]
    first_diff: int | None  # first step whose tokens differ
    message: str


def compare_outputs(runs: dict[str, Run]) -> Agreement:
    """Token-for-token comparison of the generated ids (all batch rows) of several runs."""
    lengths = {m: len(r.events) for m, r in runs.items()}
    if len(runs) < 2:
        return Agreement(False, min(lengths.values(), default=0), lengths, None, "only one mode ran, so nothing was compared")
    seqs = {m: [e.token_ids or (e.token_id,) for e in r.events] for m, r in runs.items()}
    n = min(lengths.values())
    ref_mode = next(iter(seqs))
    first = next((i for i in range(n) if any(seqs[m][i] != seqs[ref_mode][i] for m in seqs)), None)
    same_len = len(set(lengths.values())) == 1
    if first is not None:
        diff = {m: seqs[m][first] for m in seqs}
        msg = f"outputs differ at step {first}: " + ", ".join(f"{m}={v}" for m, v in diff.items())
        return Agreement(False, n, lengths, first, msg)
    if not same_len:
        msg = f"the first {n} tokens match, but the runs have different lengths: {lengths}"
        return Agreement(False, n, lengths, None, msg)
    return Agreement(True, n, lengths, None, f"all {len(runs)} modes produced the same {n} tokens, token for token")


# --- prompts of a given length ----------------------------------------------------------------

def cycle_to(ids: Sequence[int], length: int) -> tuple[int, ...]:
    """``ids`` repeated and cut to exactly ``length`` tokens (keeps any tokenizer's ids valid)."""
    if not ids:
        raise ValueError("cannot build a prompt from zero tokens")
    reps = -(-length // len(ids))
    return tuple((list(ids) * reps)[:length])


def document_ids(model: LoadedModel, length: int, fallback: Sequence[int] = (0,)) -> tuple[int, ...]:
    """A "pasted document" of exactly ``length`` tokens."""
    base = model.tokenizer.encode(DOCUMENT) if model.has_tokenizer else list(fallback)
    return cycle_to(base, length)


def batch_rows(model: LoadedModel, base: Sequence[int], batch: int, length: int,
               different: bool) -> tuple[tuple[int, ...], ...]:
    """(batch, length) prompt rows: ``base`` repeated, or distinct texts cut to one length."""
    if not different:
        return (cycle_to(base, length),) * batch
    rows = []
    for i in range(batch):
        if model.has_tokenizer:
            ids = model.tokenizer.encode(DIFFERENT_TEXTS[i % len(DIFFERENT_TEXTS)] + DOCUMENT)
        else:  # ids only: rotate the base so each row still differs
            ids = list(base[i % len(base):]) + list(base[: i % len(base)])
        rows.append(cycle_to(ids, length))
    return tuple(rows)


def sweep_ns(prompt_len: int, block_size: int, ns: Sequence[int] = SWEEP_NS) -> list[int]:
    """The sweep's N values that fit the context (prompt + N <= block_size)."""
    return [n for n in ns if prompt_len + n <= block_size]


def prompt_lengths(block_size: int, first: int = 16, n_new: int = 1) -> list[int]:
    """16, 24, 32, 48, ... (a x1.5 / x1.33 grid) up to the longest prompt that still fits."""
    top = block_size - n_new
    out, p = [], first
    while p < top:
        out.append(p)
        p = p * 3 // 2 if p & (p - 1) == 0 else p * 4 // 3  # 16, 24, 32, 48, 64, ...
    out.append(top)
    return sorted(set(x for x in out if 1 <= x <= top))


# --- sweeps ---------------------------------------------------------------------------------

def _decode_ms(run: Run) -> float:
    """TPOT as Run.mean_tpot_ms defines it (the mean decode step), so tokens/s = 1000 / it everywhere."""
    t = run.mean_tpot_ms
    return float("nan") if t is None else t


def _tag(model: LoadedModel) -> dict[str, str]:
    return {"device": str(model.device), "dtype": model.dtype_name}


def sweep_total_time(model: LoadedModel, req: Request, ns: Sequence[int], repeats: int = 3,
                     modes: Sequence[str] = ("static", "none"), warm: bool = True) -> Iterator[Sample]:
    """Total generation time vs N new tokens, each mode, ``repeats`` times; small N first.

    Modes alternate inside each repeat so that slow drift (another job, thermal) hits both alike.
    """
    if warm:
        warmup(model, modes)
    total, done = len(ns) * repeats * len(modes), 0
    for n in ns:
        for rep in range(repeats):
            for mode in modes:
                run = run_once(model, req.with_(max_new_tokens=n), mode)
                done += 1
                yield Sample("total_time", mode, n, rep, {
                    "total_ms": run.total_ms, "ttft_ms": run.ttft_ms or 0.0, "tpot_ms": _decode_ms(run),
                    "tokens": len(run.events), "flops": run.total_flops,
                }, done=done, total=total, **_tag(model))


def sweep_ttft(model: LoadedModel, base: Sequence[int], lengths: Sequence[int], repeats: int = 3,
               warm: bool = True, fast: bool = True) -> Iterator[Sample]:
    """Time to first token (the prefill forward) vs prompt length, with its FLOPs and bytes."""
    if warm:
        warmup(model, ("static",))
    cfg, nbytes = model.config, _dtype_bytes(model)
    total, done = len(lengths) * repeats, 0
    # Repeats on the outside: a drift (another job) spreads over all lengths, and a stopped
    # sweep still has the whole curve.
    for rep in range(repeats):
        for length in lengths:
            req = Request(prompt_ids=(cycle_to(base, length),), max_new_tokens=1, backend=backend_name(fast))
            ev = run_once(model, req, "static").events[0]
            done += 1
            flops = forward_flops(cfg, length, 0)
            byts = forward_bytes(cfg, length, 0, nbytes)
            yield Sample("ttft", "prefill", length, rep, {
                "ttft_ms": ev.latency_ms, "flops": flops, "bytes": byts, "intensity": flops / byts,
                "flops_per_s": flops / (ev.latency_ms / 1000.0),
            }, done=done, total=total, **_tag(model))


def sweep_decode(model: LoadedModel, base: Sequence[int], repeats: int = 3, prompt_len: int = 16,
                 max_context: int | None = None, warm: bool = True, fast: bool = True) -> Iterator[Sample]:
    """Per-token decode latency vs context length: one long cached run per repeat, a sample per step."""
    if warm:
        warmup(model, ("static",))
    cfg, nbytes = model.config, _dtype_bytes(model)
    top = min(max_context or cfg.block_size, cfg.block_size)
    n_new = top - prompt_len
    if n_new < 2:
        raise ValueError(f"a {prompt_len}-token prompt leaves no room to decode in a {top}-token context")
    req = Request(prompt_ids=(cycle_to(base, prompt_len),), max_new_tokens=n_new, backend=backend_name(fast))
    total, done = repeats * (n_new - 1), 0
    for rep in range(repeats):
        for ev in start(model, req, "static"):
            if ev.phase != "decode":
                continue
            done += 1
            start_pos = ev.cache_len - 1  # the new token sits at cache_len - 1 and sees cache_len keys
            byts = forward_bytes(cfg, 1, start_pos, nbytes)
            yield Sample("decode", "decode", ev.cache_len, rep, {
                "latency_ms": ev.latency_ms, "flops": ev.flops, "bytes": byts, "intensity": ev.flops / byts,
                "flops_per_s": ev.flops / (ev.latency_ms / 1000.0),
            }, done=done, total=total, **_tag(model))


def sweep_short_long(model: LoadedModel, short: Sequence[int], long_len: int, n_new: int = 32,
                     repeats: int = 3, warm: bool = True, fast: bool = True) -> Iterator[Sample]:
    """The seeds' example: a short question vs a long pasted document, same number of new tokens."""
    if warm:
        warmup(model, ("static",))
    cfg = model.config
    long_len = min(long_len, cfg.block_size - n_new)
    cases = (("short question", tuple(short)[: long_len]), ("long document", document_ids(model, long_len, short)))
    total, done = repeats * len(cases), 0
    for rep in range(repeats):
        for name, ids in cases:
            req = Request(prompt_ids=(tuple(ids),), max_new_tokens=n_new, backend=backend_name(fast))
            run = run_once(model, req, "static")
            done += 1
            yield Sample("short_long", name, len(ids), rep, {
                "ttft_ms": run.ttft_ms or 0.0, "tpot_ms": _decode_ms(run),
                "decode_tokens_per_s": run.decode_tokens_per_s or 0.0, "prompt_len": len(ids),
            }, done=done, total=total, **_tag(model))


def batch_sizes(model: LoadedModel, prompt_len: int, n_new: int, candidates: Sequence[int] = BATCH_SIZES,
                mem_fraction: float = 0.25, free_bytes: int | None = None) -> list[int]:
    """The candidate batch sizes whose cache + activations fit in a fraction of free memory."""
    free = free_bytes if free_bytes is not None else free_memory(model.device)
    return [b for b in candidates if batch_memory(model, b, prompt_len, n_new) <= mem_fraction * free]


def batch_memory(model: LoadedModel, batch: int, prompt_len: int, n_new: int) -> int:
    """Rough peak bytes of one cached batched run: the static cache (whole context, preallocated)
    plus prefill activations (a dozen (B, T, 4C) buffers and one (B, nh, T, T) score matrix)."""
    cfg, nbytes = model.config, _dtype_bytes(model)
    kv = kv_bytes_per_token(cfg.n_layer, cfg.kv_heads, cfg.head_dim, model.dtype.itemsize, batch) * cfg.block_size
    acts = batch * prompt_len * (12 * 4 * cfg.n_embd + cfg.vocab_size) * 4
    scores = batch * cfg.n_head * prompt_len * prompt_len * nbytes
    return kv + acts + scores


def free_memory(device: torch.device) -> int:
    """Bytes free on the device: CUDA's own count, else the OS's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def sweep_batch(model: LoadedModel, base: Sequence[int], sizes: Sequence[int], prompt_len: int = 32,
                n_new: int = 32, repeats: int = 3, different: bool = False,
                warm: bool = True, fast: bool = True) -> Iterator[Sample]:
    """Cached decode at each batch size: per-request latency, aggregate tokens/s and KV bytes."""
    if warm:
        warmup(model, ("static",))
    series = "different prompts" if different else "same prompt"
    total, done = len(sizes) * repeats, 0
    for rep in range(repeats):  # repeats outside, as in sweep_ttft
        for b in sizes:
            req = Request(prompt_ids=batch_rows(model, base, b, prompt_len, different), max_new_tokens=n_new,
                          backend=backend_name(fast))
            run = run_once(model, req, "static")
            done += 1
            last = run.events[-1]
            # kvviz's one tokens/s (Run.tokens_per_s: batch x 1000 / mean TPOT), and the TPOT it is from,
            # so each point's latency and throughput are one measurement read two ways.
            yield Sample("batch", series, b, rep, {
                "tpot_ms": _decode_ms(run), "ttft_ms": run.ttft_ms or 0.0, "total_ms": run.total_ms,
                "request_ms": run.total_ms,  # every request of a batch finishes with the batch
                "tokens_per_s": run.tokens_per_s or 0.0,
                "e2e_tokens_per_s": run.e2e_tokens_per_s or 0.0,
                "kv_bytes_allocated": last.cache_bytes_allocated, "kv_bytes_used": last.cache_bytes_used,
                "distinct_outputs": len({tuple(r) for r in zip(*[e.token_ids for e in run.events])}),
            }, done=done, total=total, **_tag(model))


def _dtype_bytes(model: LoadedModel) -> int:
    return model.dtype.itemsize
