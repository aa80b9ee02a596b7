"""What a chat turn leaves behind: its ``TurnRecord`` when it ends, an ``InterruptedTurn`` when it
is cut short (replaced, stopped, failing), and the ``TurnInterrupted`` error a replaced turn's
iterator raises. ``_Txn`` is the running turn's undo data (engine/sessions/conversation.py runs it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvviz.engine.kvcache.dense import Checkpoint
from kvviz.errors import KVVizError


class TurnInterrupted(KVVizError):
    """The turn was replaced by a newer one before it ended; the conversation is as it was before it."""


@dataclass(frozen=True)
class InterruptedTurn:
    """A turn that ended before its answer did: kept to show, never part of the conversation."""

    after: int  # the finished turns before it: it follows turn ``after`` (a count, 0 = first)
    user: str
    text: str  # the partial answer, decoded
    generated_tokens: int
    reason: str  # "replaced by a newer turn", "stopped", "failed: ..."


@dataclass
class _Txn:
    """One running turn: what it builds on and what a rollback puts back."""

    user: str
    base: int  # the finished turns it follows (an edit or a regenerate keeps fewer)
    held: list[int]  # the conversation's ``held`` before the turn
    params: Any = None  # the conversation's sampling parameters before the turn (a regenerate's seed)
    cp: Checkpoint | None = None
    out: list[int] = field(default_factory=list)  # tokens sampled so far
    done: bool = False


@dataclass(frozen=True)
class TurnRecord:
    """One turn, measured."""

    user: str
    text: str  # the answer, without the end token
    prompt_ids: tuple[int, ...]  # the whole conversation as the template rendered it
    generated_ids: tuple[int, ...]  # every sampled token, the end token included
    cached_before: int  # tokens the cache held when the turn began
    reused_tokens: int  # positions kept (common prefix or prefix-cache hit): not recomputed
    prefilled_tokens: int  # positions this turn's prefill computed
    ttft_ms: float  # the prefill forward + sampling of the first token
    decode_ms: float  # the rest of the answer
    cache_bytes_before: int  # bytes_used when the turn began
    cache_bytes_used: int  # bytes_used after the answer
    cache_bytes_allocated: int
    blocks_used: int | None  # paged only
    blocks_shared: int | None
    prefix_hit_blocks: int | None  # blocks taken back by hash this turn (paged only)
    stop_reason: str  # "eos" or "max_new_tokens"
    snapshots: tuple[dict[str, Any], ...] = field(default=(), compare=False)  # the pool after each step (paged)
    # What the turn ran with: a later turn may use other settings (the Chat page applies max new
    # tokens and sampling to the next turn), and the check against scratch must use these.
    max_new_tokens: int | None = None
    params: Any = None  # the SamplingParams of this turn
    made_on: str = ""  # the model and cache that computed it (Conversation.label())
    # The same prompt prefilled from scratch on a fresh cache, timed right after the turn
    # (Conversation.time_without_reuse): what this turn's TTFT would have been with no reuse.
    no_reuse_ttft_ms: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def generated_tokens(self) -> int:
        return len(self.generated_ids)

    def to_dict(self) -> dict[str, Any]:
        return {
            "user": self.user, "text": self.text, "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens, "cached_before": self.cached_before,
            "ttft_ms": self.ttft_ms, "decode_ms": self.decode_ms, "cache_bytes_before": self.cache_bytes_before,
            "cache_bytes_used": self.cache_bytes_used, "cache_bytes_allocated": self.cache_bytes_allocated,
            "blocks_used": self.blocks_used, "blocks_shared": self.blocks_shared,
            "prefix_hit_blocks": self.prefix_hit_blocks, "stop_reason": self.stop_reason,
            "max_new_tokens": self.max_new_tokens, "made_on": self.made_on, "no_reuse_ttft_ms": self.no_reuse_ttft_ms,
            "prompt_ids": list(self.prompt_ids), "generated_ids": list(self.generated_ids),
        }
