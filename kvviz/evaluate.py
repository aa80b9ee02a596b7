"""Held-out quality: bits per byte, tokenizer-independent (total nats / ln 2 / bytes).

Windows of ``block_size`` tokens slide with a stride of half a block; each window scores only
the tokens the previous one did not, so every scored token sees at least half a block of
context (the first window scores all of its tokens after the first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvviz.engine.core.step import run_step
from kvviz.engine.loading.loader import LoadedModel
from kvviz.errors import KVVizError
from kvviz.safeio import read_maybe_gzip

MAX_EVAL_BYTES = 20_000_000  # scored bytes
MAX_EVAL_FILE_BYTES = 200_000_000  # the file read to take its last fraction from


@dataclass(frozen=True)
class EvalText:
    text: str
    dropped_bytes: int  # bytes that were not valid UTF-8 (or a character cut by the fraction)


@dataclass(frozen=True)
class EvalResult:
    bits_per_byte: float
    nats_per_token: float
    tokens: int  # tokens scored
    bytes: int  # UTF-8 bytes of the scored tokens

    def to_dict(self) -> dict[str, float | int]:
        return {"bits_per_byte": self.bits_per_byte, "nats_per_token": self.nats_per_token,
                "tokens": self.tokens, "bytes": self.bytes}


def read_eval_text(path: Path, last_fraction: float) -> EvalText:
    """The last ``last_fraction`` of a text file's bytes, decoded; the size is bounded before reading."""
    if not 0.0 < last_fraction <= 1.0:
        raise KVVizError(f"--last-fraction must be in (0, 1] (got {last_fraction})")
    # read_bounded refuses FIFOs and devices and reads at most the limit, whatever st_size says;
    # a .gz file (the shipped corpus) is unpacked within the same limit.
    data = read_maybe_gzip(Path(path), MAX_EVAL_FILE_BYTES, f"text file {path}")
    tail = data[len(data) - int(len(data) * last_fraction):]
    if len(tail) > MAX_EVAL_BYTES:
        raise KVVizError(f"the part of {Path(path).name} to score is {len(tail):,} bytes; the limit is "
                         f"{MAX_EVAL_BYTES:,} (use a smaller --last-fraction)")
    # The split is on bytes (as training's validation split is); a cut through a multibyte
    # character, like any invalid UTF-8, is dropped rather than scored as a replacement character,
    # and counted so the caller can say how many bytes were not scored.
    text = tail.decode("utf-8", errors="ignore")
    return EvalText(text, len(tail) - len(text.encode("utf-8")))


def bits_per_byte(model: LoadedModel, text: str, batch_windows: int = 8) -> EvalResult:
    if not model.has_tokenizer:
        raise KVVizError(f"model {model.name!r} has no tokenizer, so it cannot score text")
    ids = model.tokenizer.encode(text)
    if len(ids) < 2:
        raise KVVizError("the text is too short to evaluate (needs at least 2 tokens)")
    block = model.config.block_size
    stride = max(1, block // 2)
    # (window start, first scored target index within the window)
    windows: list[tuple[int, int]] = []
    start, scored_to = 0, 1  # token 0 has no context and is never scored
    while scored_to < len(ids):
        s = max(0, min(start, len(ids) - block))
        windows.append((s, scored_to - s))
        scored_to = min(len(ids), s + block)
        start = s + stride
    total_nats = 0.0
    scored_ids: list[int] = []
    dev = model.device
    with torch.inference_mode():
        for i in range(0, len(windows), batch_windows):
            chunk = windows[i:i + batch_windows]
            for s, first in chunk:
                seq = torch.tensor(ids[s:s + block], device=dev)[None]  # (1, T)
                inp = seq[:, :-1] if seq.shape[1] > 1 else seq
                # The readable model, no cache: every position's logits under a causal mask.
                logits = run_step(model, None, inp, torch.arange(inp.shape[1], device=dev), backend="readable",
                                  last_only=False)  # (1, T-1, V)
                targets = seq[:, 1:]  # (1, T-1)
                # logits[j] predicts token j+1; score targets from index `first` on.
                lp = F.log_softmax(logits[0, first - 1:].float(), dim=-1)  # (n, V)
                tgt = targets[0, first - 1:]
                nats = -lp.gather(-1, tgt[:, None]).sum().item()
                if not math.isfinite(nats):
                    # NaN from broken weights, or inf for a token given probability 0: no figure
                    # can be reported (and NaN is not even valid JSON).
                    raise KVVizError(f"the model's log-probabilities are not finite ({nats}) in the window at "
                                     f"token {s}: its weights or config are broken")
                total_nats += nats
                scored_ids.extend(tgt.tolist())
    n_bytes = sum(len(model.tokenizer.token_bytes(t)) for t in scored_ids)
    if n_bytes == 0:
        raise KVVizError("the scored tokens have no bytes; is this the model's tokenizer?")
    return EvalResult(total_nats / math.log(2) / n_bytes, total_nats / len(scored_ids), len(scored_ids), n_bytes)
