"""What the two cache-moving decoding strategies record, beside their StepEvents (no torch).

Beam search (``engine/strategy/beam.py``) records, per step, every candidate it weighed (kept, pruned or
finished, with its score and parent row) and the cache reorder that followed: which old row each
new row was copied from and the bytes that moved. Speculative decoding (``engine/strategy/speculative.py``)
records, per verify forward, the tokens drafted, how many were accepted, and the cache positions
written and then rolled back. The charts draw these; the CLI's JSON carries them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BeamCandidate:
    parent: int  # the cache row (running beam) this candidate extends
    token_id: int
    token_text: str  # display text of token_id
    score: float  # accumulated log-probability (sum over the beam's generated tokens)
    status: str  # "kept" (a running beam next step) | "finished" (ended: EOS or length) | "pruned"
    row: int | None = None  # the cache row it occupies next step, when kept
    final_score: float | None = None  # score / generated_len ** length_penalty, when finished


@dataclass(frozen=True)
class BeamStep:
    step: int  # 0 = the prefill's step
    position: int  # the position the new tokens occupy
    candidates: tuple[BeamCandidate, ...]  # the top 2k (or (1 + #EOS) k) continuations, best first
    parents: tuple[int, ...]  # new row r was copied from old row parents[r] (the reorder index)
    rows_before: int  # cache rows before the reorder (1 at the fan-out after the prefill)
    bytes_moved: int  # bytes the reorder copied (0 when no cache, or on the last step)
    cache_len: int  # positions held per row when the reorder ran
    latency_ms: float  # forward + scoring + reorder


@dataclass(frozen=True)
class BeamResult:
    num_beams: int
    length_penalty: float
    early_stopping: bool | str
    num_return_sequences: int
    sequences: tuple[tuple[int, ...], ...]  # generated ids of the returned beams, best first
    texts: tuple[str, ...]
    scores: tuple[float, ...]  # transformers' sequences_scores: sum log p / len ** length_penalty
    finished: tuple[bool, ...]  # False only for a slot no beam ever filled (score -1e9)
    steps: tuple[BeamStep, ...] = ()

    @property
    def bytes_moved(self) -> int:
        return sum(s.bytes_moved for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_beams": self.num_beams, "length_penalty": self.length_penalty,
            "early_stopping": self.early_stopping, "num_return_sequences": self.num_return_sequences,
            "sequences": [{"generated_ids": list(s), "text": t, "score": sc, "finished": f}
                          for s, t, sc, f in zip(self.sequences, self.texts, self.scores, self.finished)],
            "bytes_moved": self.bytes_moved,
            "steps": [{"step": s.step, "position": s.position, "parents": list(s.parents),
                       "rows_before": s.rows_before, "bytes_moved": s.bytes_moved,
                       "candidates": [{"parent": c.parent, "token_id": c.token_id, "score": c.score,
                                       "status": c.status, "row": c.row, "final_score": c.final_score}
                                      for c in s.candidates]} for s in self.steps],
        }


@dataclass(frozen=True)
class SpecStep:
    step: int  # verify forward index (0 = the prefill, which drafts nothing)
    position: int  # first position this forward wrote
    drafted: tuple[int, ...]  # draft token ids (empty: no n-gram match, a plain decode step)
    accepted: int  # how many leading drafts the model agreed with
    emitted: tuple[int, ...]  # the accepted drafts plus the model's own next token
    rolled_back: tuple[int, ...]  # positions written by this forward, then truncated away
    ngram: int  # length of the n-gram that matched (0: none)
    forward_ms: float  # the verify forward + acceptance + rollback
    drafted_text: tuple[str, ...] = ()  # display text of each draft token


@dataclass(frozen=True)
class SpecResult:
    draft_tokens: int
    ngram: int
    steps: tuple[SpecStep, ...] = ()

    @property
    def drafted(self) -> int:
        return sum(len(s.drafted) for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def forwards(self) -> int:
        return len(self.steps)

    @property
    def tokens(self) -> int:
        return sum(len(s.emitted) for s in self.steps)

    @property
    def forwards_saved(self) -> int:
        """Plain decoding needs one forward per token (the prefill gives the first)."""
        return self.tokens - self.forwards

    def to_dict(self) -> dict[str, Any]:
        return {
            "draft_tokens": self.draft_tokens, "ngram": self.ngram, "drafted": self.drafted,
            "accepted": self.accepted, "acceptance_rate": self.acceptance_rate, "forwards": self.forwards,
            "tokens": self.tokens, "forwards_saved": self.forwards_saved,
            "steps": [{"step": s.step, "position": s.position, "drafted": list(s.drafted), "accepted": s.accepted,
                       "emitted": list(s.emitted), "rolled_back": list(s.rolled_back), "ngram": s.ngram,
                       "forward_ms": round(s.forward_ms, 4)} for s in self.steps],
        }
