"""``python -m kvviz bench-spec``: wall-clock of speculative decoding (prompt lookup) against plain greedy.

Both run greedy on the same model and prompt, in this process, interleaved (plain, speculative,
plain, ...) after one warm-up each, so drift in the machine's load hits both alike; figures are
medians of the repeats. The clock is the whole ``generate()`` call: prefill, every forward, the
drafting and the event bookkeeping. The tokens must be identical (greedy): the JSON says so.

Four prompts: three where speculation should win (copying a pasted paragraph, whose answer is
the prompt again; repeating pasted code with one edit, whose answer copies long runs of the
context; counting, whose ", " n-gram drafts the next numbers) and one where it should not (a
free-form explanation: short n-grams such as "the" still match, the drafts that follow them are
wrong, and each verify forward feeds several tokens for one token of output).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median
from typing import Any

from kvviz.engine.generation.events import Run
from kvviz.engine.api import generate
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.valid_request import Speculative
from kvviz.engine.loading.loader import LoadedModel


CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] == "paid":
            total += order["amount"]
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
'''
# A paragraph the model is asked to copy: its answer repeats the prompt, so nearly every draft is
# accepted. About 60 tokens, longer than the Decoding strategies page's N.
PARAGRAPH = ("The KV cache keeps the keys and values of every token the model has already read, layer by layer, "
             "so each new token only computes its own and reads the rest from memory. Reading is cheap compared "
             "with recomputing, but the cache grows with the context and with the batch.")
PROMPTS: dict[str, str] = {
    "copy_text": f"Repeat this paragraph word for word:\n\n{PARAGRAPH}",
    "code_edit": f"Here is a Python function:\n\n{CODE}\nRepeat this function exactly, but rename the "
                 "function to `summarise`. Reply with the code only.",
    "counting": "Count from 1 to 40, separated by commas.",
    "free_text": "Explain in one paragraph why the sky is blue.",
}


@dataclass(frozen=True)
class SpecComparison:
    prompt: str
    plain_s: tuple[float, ...]
    spec_s: tuple[float, ...]
    tokens: int
    same_tokens: bool
    drafted: int
    accepted: int
    forwards: int
    forwards_saved: int
    fed: int  # tokens fed through the speculative run's decode forwards (drafts + the last token)

    @property
    def speedup(self) -> float:
        return median(self.plain_s) / median(self.spec_s)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "tokens": self.tokens, "same_tokens": self.same_tokens,
                "plain_s_median": median(self.plain_s), "spec_s_median": median(self.spec_s),
                "plain_tok_s": self.tokens / median(self.plain_s), "spec_tok_s": self.tokens / median(self.spec_s),
                "speedup": self.speedup, "plain_s": list(self.plain_s), "spec_s": list(self.spec_s),
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "forwards": self.forwards, "forwards_saved": self.forwards_saved,
                "fed_per_decode_forward": self.fed / max(1, self.forwards - 1)}


def compare(model: LoadedModel, prompt: str, max_new_tokens: int = 64, repeats: int = 5, draft_tokens: int = 10,
            ngram: int = 2, chat: bool | None = None, ignore_eos: bool = False) -> SpecComparison:
    """Plain greedy vs speculative greedy on one prompt: interleaved, warm-up discarded."""
    return compare_runs(model, prompt, max_new_tokens, repeats, draft_tokens, ngram, chat, ignore_eos)[0]


def compare_runs(model: LoadedModel, prompt: str, max_new_tokens: int = 64, repeats: int = 5,
                 draft_tokens: int = 10, ngram: int = 2, chat: bool | None = None,
                 ignore_eos: bool = False) -> tuple[SpecComparison, Run, Run]:
    """``compare``, with the last plain and speculative Runs (the page draws them).

    ``ignore_eos`` runs both to ``max_new_tokens`` (the page's timing does: N tokens each, whatever
    the answer's length); greedy, the two still produce the same tokens.
    """
    if chat is None:
        chat = bool(getattr(model.tokenizer, "chat_template", None))
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, chat=chat,
                              sampling=SamplingParams(greedy=True, ignore_eos=ignore_eos))
    spec_kw = dict(kw, strategy=Speculative(draft_tokens=draft_tokens, ngram=ngram))
    times: dict[str, list[float]] = {"plain": [], "spec": []}
    runs = {}
    for r in range(repeats + 1):
        for name, args in (("plain", kw), ("spec", spec_kw)):
            t0 = time.perf_counter()
            runs[name] = generate(model, prompt, **args)
            if r:  # the first round warms both up
                times[name].append(time.perf_counter() - t0)
    plain, spec = runs["plain"], runs["spec"]
    sp = spec.speculation
    assert sp is not None
    got = SpecComparison(prompt, tuple(times["plain"]), tuple(times["spec"]), len(spec.generated_ids),
                         plain.generated_ids == spec.generated_ids, sp.drafted, sp.accepted, sp.forwards,
                         sp.forwards_saved, sum(len(s.drafted) + 1 for s in sp.steps[1:]))
    return got, plain, spec
