"""Speculative decoding by prompt lookup: draft from the context itself, verify in one forward, roll back.

Drafting (transformers' ``PromptLookupCandidateGenerator``): for n = ``ngram`` down to 1, find the
first (leftmost) earlier occurrence of the last n tokens and propose the (up to) ``draft_tokens``
tokens that followed it, cut before an EOS. No match: no draft, an ordinary decode step.

Verification: one forward feeds the last committed token and the k drafts through the cache (a
chunked prefill at ``cache.pos``), giving the model's distribution after each of them. Greedy
keeps the longest prefix of drafts equal to the model's argmax, plus the model's own next token,
so the text is token-identical to plain greedy decoding (up to the float rounding of a batched
forward against a one-row one, which can only matter on an exact near-tie). The positions of
rejected drafts are then dropped with ``cache.truncate``: the rollback. Each verify runs through
the step driver (``run_step``: plan, forward, commit) with ``hash_ids=False``: the ids fed are not
told to the cache, since a paged cache would hash the blocks that drafts filled before the
rollback drops them, so a speculative run's blocks are not offered for prefix reuse.

Sampling uses the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023) with a point-
mass draft distribution q = delta(x), since the drafter is deterministic: accept x with probability
min(1, p(x) / q(x)) = p(x); on rejection sample from the residual max(0, p - q), which is p with x
removed and renormalised. Then P(x) = p(x) and, for y != x, P(y) = (1 - p(x)) p(y) / (1 - p(x)) =
p(y): the output distribution is exactly the target's. It draws its random numbers differently
from plain sampling, so the same seed gives the same distribution, not the same tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from kvviz.engine.core.step import run_step
from kvviz.engine.kvcache.paged_cache import PagedKVCache
from kvviz.engine.generation.events import StepEvent
from kvviz.engine.core.stream_base import Emitted
from kvviz.engine.generation.valid_request import SpecOptions
from kvviz.engine.generation.sampling import SamplingParams, filter_logits, make_generator
from kvviz.engine.generation.strategy_events import SpecResult, SpecStep
from kvviz.engine.strategy.strategy_stream import StrategyStream
from kvviz.errors import KVVizError

def prompt_lookup(ids: Sequence[int], ngram: int, k: int, eos_ids: Sequence[int] = ()) -> tuple[list[int], int]:
    """(draft, n): up to k tokens that followed the leftmost earlier match of the last n tokens."""
    L = len(ids)
    if k < 1:
        return [], 0
    for n in range(min(ngram, L - 1), 0, -1):
        tail = list(ids[L - n:])
        for i in range(L - n):  # the window at L - n is the tail itself, with nothing after it
            if list(ids[i: i + n]) == tail:
                draft = list(ids[i + n: min(i + n + k, L)])
                for j, t in enumerate(draft):
                    if t in eos_ids:  # never draft past an end: the model could accept the EOS and go on
                        draft = draft[:j]
                        break
                return draft, n  # transformers stops at the first match with a continuation
    return [], 0


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[int, int]:
    """(accepted, next token) from (T, V) logits, T = len(draft) + 1: row i predicts after input i."""
    targets = torch.argmax(logits, dim=-1).tolist()  # (T,)
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a, targets[a]


def verify_sampled(probs: torch.Tensor, draft: Sequence[int], gen: torch.Generator) -> tuple[int, int]:
    """The rejection rule for a point-mass draft: (accepted, next token) from (T, V) probabilities."""
    for i, x in enumerate(draft):
        u = torch.rand((), generator=gen, device=probs.device)
        if float(u) < float(probs[i, x]):
            continue  # accepted with probability p(x)
        residual = probs[i].clone()
        residual[x] = 0.0  # max(0, p - delta_x): p without x (p(x) < 1 here, so it keeps some mass)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=gen))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(T, V) logits -> the sampler's own distribution (temperature, top-k, top-p), as ``sample`` draws."""
    shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
    return torch.softmax(filter_logits(shifted, params), dim=-1)


@dataclass
class SpeculativeStream(StrategyStream):
    # Each verify forward's record. ``cache`` (StreamBase) is kept after the run: tests compare it
    # with a never-speculated one.
    spec_steps: list[SpecStep] = field(default_factory=list)

    @property
    def opts(self) -> SpecOptions:
        assert self.req.spec is not None, "a SpeculativeStream runs a request with speculative options"
        return self.req.spec

    def _extra(self) -> dict[str, object]:
        return {"speculation": SpecResult(self.opts.draft_tokens, self.opts.ngram, tuple(self.spec_steps))}

    def _loop(self) -> Iterator[StepEvent]:
        m, o, params = self.model, self.opts, self.req.params
        cfg, dev, tok = m.config, m.device, m.tokenizer
        eos_ids = () if tok.eos_token_id is None or self.req.ignore_eos else (tok.eos_token_id,)
        gen = None if params.greedy else make_generator(params, dev)
        ids = list(self.prompt_ids)
        N, made, step = len(ids), 0, 0
        with torch.inference_mode():
            positions = torch.arange(cfg.block_size, device=dev)
            cache = self.cache = self._cache(1, len(ids) + self.max_new_tokens + o.draft_tokens)
        if isinstance(cache, PagedKVCache):  # its sliding layers keep the blocks a rollback needs
            cache.rollback = o.draft_tokens
        rings = [w for w in getattr(cache, "windows", ()) if w is not None]
        if rings and len(ids) + self.max_new_tokens + o.draft_tokens > min(rings):  # drafts written too
            # a rollback needs positions the sliding layers' rings will have overwritten
            raise KVVizError(f"speculative decoding rolls the cache back, but this model's static cache keeps "
                             f"only the last {min(rings):,} positions on its sliding layers and this run goes "
                             f"past them: use CacheSpec(kind='concat') (it keeps every position) or kind='paged' (it keeps the "
                             f"blocks a rollback needs)")
        while made < self.max_new_tokens:
            with torch.inference_mode():
                t0 = time.perf_counter()
                if step == 0:  # the prefill drafts nothing: it yields the first token
                    fed, draft, n = ids, [], 0
                else:
                    room = cfg.block_size - cache.pos - 1  # positions left once the last token is fed
                    k = min(o.draft_tokens, self.max_new_tokens - made - 1, room)
                    draft, n = prompt_lookup(ids, o.ngram, k, eos_ids)
                    fed = [ids[-1], *draft]
                p0, T = cache.pos, len(fed)
                inp = torch.tensor([fed], dtype=torch.long, device=dev)  # (1, T)
                # Plan, forward, commit (the rollback below truncates what the drafts wrote).
                logits = run_step(m, cache, inp, positions[p0: p0 + T], backend=self.engine, last_only=step == 0,
                                  hash_ids=False)
                rows = logits[0, -1:] if step == 0 else logits[0]  # (T', V): row i predicts after fed[i]
                rows = rows.float()
                self._check_finite(rows, step)
                if params.greedy:
                    a, nxt = verify_greedy(rows, draft)
                else:
                    assert gen is not None
                    a, nxt = verify_sampled(target_probs(rows, params), draft, gen)
                if step:
                    cache.truncate(p0 + 1 + a)  # the rollback: keep the fed token and the accepted drafts
                emitted = [*draft[:a], nxt]
                for j, t in enumerate(emitted):
                    if t in eos_ids:
                        emitted = emitted[: j + 1]
                        break
                emitted = emitted[: self.max_new_tokens - made]
                ms = (time.perf_counter() - t0) * 1000.0
                rolled = tuple(range(p0 + 1 + a, p0 + T)) if step else ()
                self.spec_steps.append(SpecStep(step, p0, tuple(draft), a, tuple(emitted), rolled, n, ms,
                                                tuple(tok.token_display(t) for t in draft)))
                # One event per emitted token: the first carries the verify forward's input and FLOPs.
                evs = [self._event(Emitted(step=made + j, ids=[t], position=N + made + j, input_len=T if j == 0 else 0,
                                           start=p0, rows=1, latency_ms=ms / len(emitted),
                                           logits=rows[min(j, rows.shape[0] - 1)], n_logits=rows.shape[0]), cache)
                       for j, t in enumerate(emitted)]
            for ev in evs:
                ids.append(ev.token_id)
                made += 1
                new_chars = self._emit(ev)
                yield ev
                if self._ended(ev.token_id, new_chars, eos_ids):
                    return
            step += 1
        self.stop_reason = "max_new_tokens"
