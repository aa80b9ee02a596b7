"""Beam search over the KV cache, step for step what transformers' ``generate(num_beams=k, do_sample=False)`` does.

The prompt is prefilled once (one cache row) and fanned out to k rows by ``cache.reorder``. Each
step scores every row's next token (log-softmax added to the row's running log-probability),
keeps the best ``max(2, 1 + #EOS) * k`` continuations of all k x V, and then:
- the best k that did not end (EOS, or the length limit) become the next running beams, and the
  cache rows are reordered by their parents (``cache.reorder``: an ``index_select`` on the batch
  dim of every layer; the bytes it moves are counted);
- among the best k of them, those that ended join the finished list, scored
  ``sum log p / generated_len ** length_penalty``, which keeps its best k.

Stopping follows transformers 5's ``_beam_search`` (``generation/utils.py``): ``early_stopping=True``
stops once k beams have finished; ``False`` stops when the best running beam, scored at its
current length, cannot beat the worst finished one; ``"never"`` assumes, when length_penalty > 0,
that the running beam could reach the maximum length. The tensor operations below are the same
ones in the same order (batch of one prompt), so sequences and scores match transformers'.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from kvviz.engine.core.step import run_step
from kvviz.engine.generation.events import StepEvent
from kvviz.engine.core.stream_base import Emitted
from kvviz.engine.generation.valid_request import BeamOptions
from kvviz.engine.generation.strategy_events import BeamCandidate, BeamResult, BeamStep
from kvviz.engine.strategy.strategy_stream import StrategyStream

NEG = -1.0e9  # transformers' "impossible" score: added, never assigned, exactly as there


def length_norm(length: int, penalty: float) -> float:
    """``length ** penalty``, the divisor of a finished beam's score, as transformers computes it
    (a Python float) but saturated: where the power overflows a double (2 ** 2000) it is inf
    instead of an OverflowError.

    Nothing is lost by saturating: the score tensors are float32, so transformers' own division
    already turns any divisor past float32's 3.4e38 into inf (a score of -0.0). Up to a double's
    range the result is transformers' to the bit; past it, the same -0.0 transformers reaches
    from 3.4e38 on. A power that underflows is 0.0 in Python as in transformers (a score of -inf:
    at such a negative penalty only one-token beams can finish).
    """
    try:
        return float(length) ** penalty
    except OverflowError:  # length >= 2 and penalty > 0: the power is past 1.8e308
        return math.inf


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """transformers' _gather_beams: pick beams along dim 1 by (batch, n) indices."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


@dataclass
class BeamStream(StrategyStream):
    steps: list[BeamStep] = field(default_factory=list)
    result: BeamResult | None = None
    _live: str = ""  # the best running beam's text so far

    @property
    def opts(self) -> BeamOptions:
        assert self.req.beam is not None, "a BeamStream runs a request with beam options"
        return self.req.beam

    @property
    def num_beams(self) -> int:
        return self.opts.num_beams

    @property
    def text(self) -> str:
        return self.result.texts[0] if self.result is not None else self._live

    def _decode(self, ids: list[int]) -> str:
        tok = self.model.tokenizer
        return tok.decode(ids) if self.model.has_tokenizer else "".join(tok.token_display(i) for i in ids)

    def _extra(self) -> dict[str, object]:
        if self.result is not None:
            return {"beams": self.result}
        o = self.opts
        return {"beams": BeamResult(o.num_beams, o.length_penalty, o.early_stopping,
                                    o.num_return_sequences, (), (), (), (), tuple(self.steps))}

    def _loop(self) -> Iterator[StepEvent]:  # noqa: C901 - one loop, read top to bottom like transformers'
        m, o, k, N = self.model, self.opts, self.num_beams, len(self.prompt_ids)
        cfg, dev = m.config, m.device
        max_len = N + self.max_new_tokens
        lp_pen, es = o.length_penalty, o.early_stopping
        keep = max(2, 1 + len(o.eos_ids)) * k  # enough that k survive even if the best all end
        with torch.inference_mode():
            eos = torch.tensor(o.eos_ids, dtype=torch.long, device=dev)
            top_mask = torch.zeros(keep, dtype=torch.bool, device=dev)
            top_mask[:k] = True
            running = torch.full((1, k, max_len), -1, dtype=torch.long, device=dev)  # (1, k, L)
            running[:, :, :N] = torch.tensor(self.prompt_ids, dtype=torch.long, device=dev)
            seqs = running.clone()  # the finished beams
            run_scores = torch.zeros((1, k), dtype=torch.float, device=dev)
            run_scores[:, 1:] = NEG  # only row 0's tokens count at first: the rows are copies
            beam_scores = torch.full((1, k), NEG, dtype=torch.float, device=dev)
            is_fin = torch.zeros((1, k), dtype=torch.bool, device=dev)
            improvable = torch.ones((1, 1), dtype=torch.bool, device=dev)
            run_idx = torch.full((1, k, max_len - N), -1, dtype=torch.int32, device=dev)  # parent per step
            fin_idx = run_idx.clone()
            positions = torch.arange(cfg.block_size, device=dev)
            cache = self.cache = self._cache(k, max_len) if self.use_cache else None
        cur, step = N, 0
        while True:
            with torch.inference_mode():
                t0 = time.perf_counter()
                rows_before = 1 if step == 0 else k
                if step == 0:
                    inp, start = running[0, :1, :N], 0  # (1, N): the prompt, once
                elif cache is not None:
                    inp, start = running[0, :, cur - 1: cur], cur - 1  # (k, 1): each beam's newest token
                else:
                    inp, start = running[0, :, :cur], 0  # (k, cur): recomputed, nothing cached
                # Plan, forward, commit; the ids are not kept for prefix hashes (the rows are reordered next).
                logits = run_step(m, cache, inp, positions[start: start + inp.shape[1]], backend=self.engine,
                                  hash_ids=False)
                logits = logits[:, -1, :].float().expand(k, -1)  # (k, V); the prefill's one row is every row
                V = logits.shape[-1]
                log_probs = torch.log_softmax(logits, dim=-1).view(1, k, V) + run_scores[:, :, None]
                log_probs = log_probs.reshape(1, k * V)
                topk_lp, topk_flat = torch.topk(log_probs, k=keep)  # (1, keep)
                parent = topk_flat // V
                topk_ids = topk_flat % V
                topk_seqs = _take(running, parent)
                topk_seqs[:, :, cur] = topk_ids
                topk_idx = _take(run_idx, parent)
                topk_idx[:, :, cur - N] = parent.to(torch.int32)
                hits = torch.isin(topk_ids, eos) | (cur + 1 >= max_len)  # (1, keep): EOS or the length limit

                # The best k that go on; ended ones are pushed out of reach.
                run_lp = topk_lp + hits.to(torch.float32) * NEG
                nxt = torch.topk(run_lp, k=k)[1]
                running, run_scores, run_idx = _take(topk_seqs, nxt), _take(run_lp, nxt), _take(topk_idx, nxt)

                # The finished list: only the best k candidates may end here.
                did = hits & top_mask[None, :]
                fin_lp = topk_lp / length_norm(cur + 1 - N, lp_pen)
                fin_lp += (torch.all(is_fin, dim=-1, keepdim=True) & (es is True)).to(torch.float32) * NEG
                fin_lp += (~improvable).to(torch.float32) * NEG
                fin_lp += (~did) * NEG
                merged = torch.topk(torch.cat((beam_scores, fin_lp), dim=1), k=k)[1]
                seqs = _take(torch.cat((seqs, topk_seqs), dim=1), merged)
                beam_scores = _take(torch.cat((beam_scores, fin_lp), dim=1), merged)
                fin_idx = _take(torch.cat((fin_idx, topk_idx), dim=1), merged)
                is_fin = _take(torch.cat((is_fin, did), dim=1), merged)

                parents = run_idx[0, :, cur - N].long()  # (k,) old row of each new row
                cur += 1
                # transformers' early-stop heuristic, then its three reasons to go on.
                if es == "never" and lp_pen > 0.0:
                    best_len = max_len - N
                else:
                    best_len = cur - N
                best_running = run_scores[:, :1] / length_norm(best_len, lp_pen)
                worst_fin = torch.where(is_fin, torch.min(beam_scores, dim=1, keepdim=True)[0], NEG)
                improvable = improvable & torch.any(best_running > worst_fin, dim=-1, keepdim=True)
                go_on = bool(torch.any(improvable)) and not (bool(torch.all(is_fin)) and es is True) \
                    and not bool(torch.all(hits))
                moved = 0
                if cache is not None and go_on:  # the last step's reorder would feed nothing
                    moved = cache.reorder(parents if rows_before == k else torch.zeros_like(parents))
                latency_ms = (time.perf_counter() - t0) * 1000.0

                self.steps.append(self._record(
                    step, cur - 1, topk_lp=topk_lp, parent=parent, ids=topk_ids, hits=hits, did=did, fin_lp=fin_lp,
                    nxt=nxt, merged=merged, parents=parents, rows_before=rows_before, moved=moved,
                    cache_len=cache.pos if cache is not None else 0, latency_ms=latency_ms))
                new_ids = running[0, :, cur - 1].tolist()
                self._live = self._decode(running[0, 0, N:cur].tolist())
                ev = self._event(Emitted(step=step, ids=new_ids, position=cur - 1, input_len=inp.shape[1],
                                         start=start, rows=inp.shape[0], latency_ms=latency_ms, logits=logits[0]),
                                 cache)
            self.events.append(ev)
            yield ev
            step += 1
            if not go_on:
                break
        self._finish(seqs, beam_scores, fin_idx, is_fin, N)

    def _record(self, step: int, position: int, *, topk_lp: torch.Tensor, parent: torch.Tensor, ids: torch.Tensor,
                hits: torch.Tensor, did: torch.Tensor, fin_lp: torch.Tensor, nxt: torch.Tensor, merged: torch.Tensor,
                parents: torch.Tensor, rows_before: int, moved: int, cache_len: int, latency_ms: float) -> BeamStep:
        """Every weighed candidate with what became of it (plain Python, for the views)."""
        tok, k = self.model.tokenizer, self.num_beams
        row_of = {int(j): r for r, j in enumerate(nxt[0].tolist())}
        joined = {int(j) - k for j in merged[0].tolist() if j >= k}  # candidates that entered the finished list
        scores, fins, dids, ended = topk_lp[0].tolist(), fin_lp[0].tolist(), did[0].tolist(), hits[0].tolist()
        cands = []
        for j, (p, t) in enumerate(zip(parent[0].tolist(), ids[0].tolist())):
            if dids[j] and j in joined:
                status, row, final = "finished", None, fins[j]
            elif j in row_of and not ended[j]:
                status, row, final = "kept", row_of[j], None
            else:
                status, row, final = "pruned", None, None
            cands.append(BeamCandidate(p if rows_before == k else 0, t, tok.token_display(t), scores[j], status,
                                       row, final))
        return BeamStep(step, position, tuple(cands), tuple(parents.tolist()) if rows_before == k
                        else (0,) * k, rows_before, moved, cache_len, latency_ms)

    def _finish(self, seqs: torch.Tensor, scores: torch.Tensor, fin_idx: torch.Tensor, is_fin: torch.Tensor,
                N: int) -> None:
        o = self.opts
        n = o.num_return_sequences
        lens = (fin_idx[0, :n] + 1).bool().sum(dim=-1).tolist()  # generated length of each returned beam
        out = tuple(tuple(seqs[0, r, N: N + lens[r]].tolist()) for r in range(n))
        self.result = BeamResult(
            o.num_beams, o.length_penalty, o.early_stopping, n, out,
            tuple(self._decode(list(s)) for s in out), tuple(scores[0, :n].tolist()),
            tuple(is_fin[0, :n].tolist()), tuple(self.steps))
        best = out[0] if out else ()
        self.stop_reason = "eos" if best and best[-1] in o.eos_ids else "max_new_tokens"
