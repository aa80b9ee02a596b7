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

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from kvviz.engine.generation.events import Run
from kvviz.engine.api import generate
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.specs import Speculative
from kvviz.engine.loading.loader import LoadedModel, load_model
from kvviz.fast.heap import freeze_long_lived
from kvviz.measure.cpu_load import others_busy_cores, read_cpu
from kvviz.hostinfo import cpu_name
from kvviz.safeio import prepare_out, save_results

DEFAULT_OUT = Path("bench-results") / "spec.json"

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


def add_spec_bench_arguments(p: argparse.ArgumentParser) -> None:
    import kvviz.cli.argtypes as types

    p.add_argument("--model", default="smollm2", help="default | smollm2 | random:NAME | a folder")
    p.add_argument("--repeats", type=types.repeats, default=5, help="timed runs of each (after one warm-up)")
    p.add_argument("--max-new-tokens", type=types.token_count, default=64)
    p.add_argument("--draft-tokens", type=types.draft_tokens, default=10)
    p.add_argument("--ngram", type=types.ngram, default=2)
    p.add_argument("--ignore-eos", action="store_true",
                   help="run both to --max-new-tokens through EOS (every run the same length)")
    p.add_argument("--threads", type=types.threads, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", type=types.out_file, default=DEFAULT_OUT, help="where to write the JSON results")
    p.add_argument("--json", action="store_true")


def run_spec_bench(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import torch

    prepare_out(args.out, DEFAULT_OUT)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    freeze_long_lived()
    before = read_cpu()
    results = {name: compare(model, text, args.max_new_tokens, args.repeats, args.draft_tokens, args.ngram,
                             ignore_eos=args.ignore_eos)
               for name, text in PROMPTS.items()}
    after = read_cpu()
    busy = None if before is None or after is None else round(others_busy_cores(before, after,
                                                                                os.sysconf("SC_CLK_TCK")), 2)
    obj = {"model": model.name, "cpu": cpu_name(), "torch_threads": torch.get_num_threads(),
           "others_busy_cores": busy, "repeats": args.repeats,
           "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
           "draft_tokens": args.draft_tokens, "ngram": args.ngram,
           "results": {k: v.to_dict() for k, v in results.items()}, "out": str(args.out)}
    save_results(args.out, json.dumps(obj, indent=1) + "\n")
    lines = [f"{model.name}: plain greedy vs prompt-lookup speculation ({args.draft_tokens} drafts, n-gram "
             f"{args.ngram}), medians of {args.repeats}, {obj['torch_threads']} threads; other processes kept "
             f"{busy} cores busy meanwhile"]
    for name, r in obj["results"].items():
        rate = "n/a" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        lines.append(f"  {name:10s} plain {r['plain_tok_s']:6.1f} tok/s  speculative {r['spec_tok_s']:6.1f} tok/s  "
                     f"x{r['speedup']:.2f}  accepted {r['accepted']}/{r['drafted']} ({rate})  "
                     f"forwards {r['forwards']} for {r['tokens']} tokens ({r['fed_per_decode_forward']:.1f} fed per decode "
                     f"forward)  same tokens: {r['same_tokens']}")
    return obj, "\n".join(lines)
