"""``kvviz`` (= ``python -m kvviz``) ``{app,models,generate,chat,bench,bench-spec,memory,eval,train,kv-curves}``:
one table, SUBCOMMANDS; ``kvviz --version``.

Every subcommand but ``app`` (which serves until stopped) takes ``--json`` and then prints exactly one JSON object on stdout. Bad
arguments and bad input get argparse-style messages (``kvviz <cmd>: error: ...``) and exit 2;
a traceback means a bug.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import kvviz.cli.argtypes as types
from kvviz.cli.argtypes import finite_float as _float
from kvviz.cli.argtypes import nonneg_int as _nonneg_int
from kvviz.cli.argtypes import positive_int as _positive_int
from kvviz.errors import KVVizError, ResultsNotSaved
from kvviz.cli.kv_cli import add_kv_arguments
from kvviz.cli.request_args import add_sampling_arguments, cache_from_args, sampling_from_args, strategy_from_args


def _id_list(s: str) -> list[int]:
    try:
        ids = [types.token_id(x) for x in s.replace(" ", "").split(",") if x != ""]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"comma-separated token ids like 1,2,3: {e}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _json_safe(obj: Any) -> Any:
    """NaN and infinities become null: ``json.dumps`` would print ``NaN``, which is not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(_json_safe(obj), ensure_ascii=False, allow_nan=False))
    else:
        print(text)


# ----------------------------------------------------------------------------- generate
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="default | smollm2 | gemma3 | shakespeare | random:NAME | a model folder | a .gguf file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_id_list, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=types.token_count, default=64)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--cache-kind", choices=["static", "concat", "paged"], default="static")
    p.add_argument("--block-size", type=types.kv_block_size, default=16, help="tokens per block of --cache-kind paged")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template (instruct models)")
    p.add_argument("--parse-special", action="store_true",
                   help="with --chat: read special-token text in the prompt (<|im_end|>...) as control tokens; "
                        "by default it is plain text, so typed text cannot end the turn or forge another")
    p.add_argument("--no-fast", action="store_true",
                   help="run every step through the readable model, without the accelerator (kvviz.fast)")
    add_sampling_arguments(p)
    p.add_argument("--stop", nargs="+", default=[], metavar="STR", help="stop strings")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens, treating EOS as an ordinary token "
                        "(vLLM's name; for timing)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    beam = p.add_argument_group("beam search (transformers' generate(num_beams=K, do_sample=False))")
    beam.add_argument("--num-beams", type=types.beams, default=1, metavar="K", help="beams (1: no beam search)")
    beam.add_argument("--length-penalty", type=_float, default=1.0, metavar="X",
                      help="a finished beam scores sum(log p) / length ** X (default 1.0)")
    beam.add_argument("--early-stopping", choices=["true", "false", "never"], default="false",
                      help="true: stop when K beams finished; false: when none can improve; never: as false, but "
                           "assume a running beam may reach the maximum length (default false)")
    beam.add_argument("--num-return-sequences", type=types.beams, default=1, metavar="N",
                      help="how many of the best finished beams to return (<= K)")
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", choices=["prompt_lookup"],
                      help="draft from the context itself and verify the drafts in one forward")
    spec.add_argument("--draft-tokens", type=types.draft_tokens, default=10, metavar="K",
                      help="tokens drafted per step")
    spec.add_argument("--ngram", type=types.ngram, default=2, metavar="N",
                      help="longest n-gram matched against the context (then shorter ones)")
    add_kv_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: the text, ids, stop reason and every step (phase, position, "
                        "cache length and bytes, latency); without it only the answer")


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], str]:
    from kvviz.engine.api import iter_generate
    from kvviz.engine.loaded import load_model
    from kvviz.fast.heap import freeze_long_lived
    from kvviz.cli.kv_cli import asked, cache_report, cache_text

    sampling = sampling_from_args(args, parser)
    if args.parse_special and not args.chat:
        parser.error("--parse-special applies to --chat (a plain prompt's special-token text is always parsed)")
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    freeze_long_lived()  # no full-heap GC pauses inside the timed steps (kvviz.fast.heap)
    stream = iter_generate(
        model, args.prompt if args.prompt_ids is None else args.prompt_ids, max_new_tokens=args.max_new_tokens,
        sampling=sampling, cache=cache_from_args(args), strategy=strategy_from_args(args), stop=args.stop,
        chat=args.chat, parse_special=args.parse_special, backend="readable" if args.no_fast else "fast")
    for _ in stream:
        pass
    run = stream.run
    obj = {
        "model": run.model, "device": run.device, "use_cache": run.use_cache, "engine": run.engine,
        "prompt_ids": list(run.prompt_ids), "generated_ids": run.generated_ids, "text": run.text,
        "stop_reason": run.stop_reason, "steps": [e.summary() for e in run.events],
    }
    text = run.answer_text  # the answer a reader wants; JSON keeps the EOS id and stop_reason
    if not text.strip() and run.stop_reason == "eos" and not args.json:
        # A blank line alone reads as a bug: say the model ended the answer, and how to get one.
        hint = ("" if args.chat or not getattr(model.tokenizer, "chat_template", None) else
                "; it is an instruct model: --chat sends the prompt through its chat template")
        print(f"note: the model emitted its end token at once (stop_reason eos){hint}", file=sys.stderr)
    if asked(args):
        obj["cache"] = cache_report(stream)
        text += "\n" + cache_text(obj["cache"])
    if run.beams is not None:
        obj["beams"] = run.beams.to_dict()
        text = "\n".join(f"[beam {i}, score {sc:.4f}] {t}" for i, (t, sc) in
                         enumerate(zip(run.beams.texts, run.beams.scores)))
    if run.speculation is not None:
        sp = run.speculation
        obj["speculation"] = sp.to_dict()
        rate = "n/a" if sp.acceptance_rate is None else f"{sp.acceptance_rate:.0%}"
        text += (f"\n[speculation: {sp.accepted}/{sp.drafted} drafted tokens accepted ({rate}), "
                 f"{sp.forwards} forwards for {sp.tokens} tokens, {sp.forwards_saved} saved]")
    return obj, text


# ----------------------------------------------------------------------------- eval
def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--text-file", type=Path, default=None,
                   help="text to score (.txt or .txt.gz); default: the shipped Tiny Shakespeare corpus")
    p.add_argument("--last-fraction", type=_float, default=1.0, help="score only the last fraction of the bytes")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_kv_arguments(p)
    p.add_argument("--max-tokens", type=types.token_count, default=512,
                   help="with a compressed cache: score the first N tokens of the text through it")
    p.add_argument("--chunk", type=types.token_count, default=64,
                   help="with a compressed cache: tokens per teacher-forced forward (1: decode on the true tokens)")
    p.add_argument("--json", action="store_true")


def run_eval(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from kvviz.engine.loading.loader import SHAKESPEARE_CORPUS
    from kvviz.engine.loaded import load_model
    from kvviz.evaluate import bits_per_byte, read_eval_text

    from kvviz.cli.kv_cli import asked, eval_text

    src = read_eval_text(args.text_file or SHAKESPEARE_CORPUS, args.last_fraction)
    model = load_model(args.model, device=args.device)
    if asked(args):
        return _eval_kv(args, model, src.text, eval_text)
    res = bits_per_byte(model, src.text)
    dropped = (f" ({src.dropped_bytes:,} bytes that were not valid UTF-8 were dropped, not scored)"
               if src.dropped_bytes else "")
    return ({**res.to_dict(), "dropped_bytes": src.dropped_bytes},
            f"{res.bits_per_byte:.4f} bits/byte over {res.bytes:,} bytes ({res.tokens:,} tokens){dropped}")


def _eval_kv(args: argparse.Namespace, model: Any, text: str,
             describe: Callable[[dict[str, Any]], str]) -> tuple[dict[str, Any], str]:
    """Teacher-forced through the compressed cache vs a full-precision one, on the same tokens."""
    from kvviz.engine.generation.request import kv_spec
    from kvviz.cli.kv_cli import kv_options
    from kvviz.measure.kvcompare import compare

    if not model.has_tokenizer:
        raise KVVizError(f"model {model.name!r} has no tokenizer, so it cannot score text")
    o = kv_options(args)
    spec = kv_spec(model, o["kv_dtype"], o["window"], o["sinks"], o["group_size"], o["zero_point"], o["fp8_scale"],
                   o["positions"], o["track_errors"])
    ids = model.tokenizer.encode(text)[: min(args.max_tokens, model.config.block_size)]
    summary = compare(model, ids, spec, chunk=args.chunk, attention=args.chunk == 1).summary()
    return summary, describe(summary)


# ----------------------------------------------------------------------------- train
def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from kvviz.train import TrainConfig

    d = TrainConfig(corpus="")
    p.add_argument("--corpus", default=None,
                   help="training text (.txt or .txt.gz); default: the shipped Tiny Shakespeare corpus")
    p.add_argument("--out", default=d.out)
    for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "steps", "warmup",
                 "eval_every", "eval_batches", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=_positive_int if name != "seed" else _nonneg_int,
                       default=getattr(d, name))
    for name in ("dropout", "lr", "min_lr", "weight_decay", "grad_clip"):
        p.add_argument("--" + name.replace("_", "-"), type=_float, default=getattr(d, name))
    p.add_argument("--threads", type=types.threads_or_default, default=0)
    p.add_argument("--amp", choices=["bf16", "off"], default=d.amp, help="bf16 autocast (fp32 master weights) or off")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state")
    p.add_argument("--no-final-eval", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")


def run_train(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from kvviz.engine.loading.loader import SHAKESPEARE_CORPUS
    from kvviz.train import TrainConfig, train

    fields = {k: getattr(args, k) for k in TrainConfig.__dataclass_fields__ if hasattr(args, k)}
    fields["corpus"] = args.corpus or str(SHAKESPEARE_CORPUS)
    fields["final_eval"] = not args.no_final_eval
    tc = TrainConfig(**fields)
    summary = train(tc, resume=args.resume, progress=not (args.no_progress or args.json))
    return summary, (f"saved {tc.out} after {summary['steps']} steps "
                     f"(val bits/byte {summary.get('val_bits_per_byte', 'n/a')})")


# ----------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Subcommand:
    """One subcommand. ``add`` and ``run`` name "module:function": imported when the parser is built
    and when the subcommand runs, never when this module is. ``add(parser)`` adds its arguments;
    ``run(args[, parser])`` returns (the JSON object, the text); ``--json`` picks which is printed."""

    name: str
    help: str
    add: str
    run: str
    with_parser: bool = False  # run takes the subparser too (for parser.error on argument combinations)
    partial_error: bool = False  # an "error" in the object: the part answered is printed, then exit 2
    serves: bool = False  # run(args) prints its own output and returns the exit status (`app`)


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("app", "serve the Streamlit app (the pages) on localhost",
               "kvviz.cli.app_cli:add_app_arguments", "kvviz.cli.app_cli:run_app", serves=True),
    Subcommand("models", "which models are installed; `kvviz models install smollm2|gemma3` adds one",
               "kvviz.cli.models_cli:add_models_arguments", "kvviz.cli.models_cli:run_models", with_parser=True),
    Subcommand("generate", "generate text (with --json: and every step's record)",
               "kvviz.cli.main:add_generate_arguments", "kvviz.cli.main:run_generate", with_parser=True),
    Subcommand("chat", "a multi-turn chat over one KV cache: what each turn reuses and prefills",
               "kvviz.cli.chat_cli:add_chat_arguments", "kvviz.cli.chat_cli:run_chat", with_parser=True,
               partial_error=True),
    Subcommand("bench", "tokens/s: kvviz cached vs uncached vs transformers",
               "kvviz.cli.bench_cli:add_bench_arguments", "kvviz.cli.bench_cli:run_bench"),
    Subcommand("bench-spec", "wall-clock: speculative decoding (prompt lookup) vs plain greedy",
               "kvviz.cli.bench_cli:add_spec_bench_arguments", "kvviz.cli.bench_cli:run_spec_bench"),
    Subcommand("memory", "KV-cache memory for a model config",
               "kvviz.cli.memory_cli:add_memory_arguments", "kvviz.cli.memory_cli:run_memory"),
    Subcommand("eval", "bits per byte of a model on a text file",
               "kvviz.cli.main:add_eval_arguments", "kvviz.cli.main:run_eval"),
    Subcommand("train", "train the byte-level GPT on a corpus",
               "kvviz.cli.main:add_train_arguments", "kvviz.cli.main:run_train"),
    Subcommand("kv-curves", "perplexity by position: full vs window vs sinks + window; per KV dtype",
               "kvviz.cli.kv_cli:add_curves_arguments", "kvviz.cli.kv_cli:run_curves"),
    Subcommand("export", "write a model as a folder transformers and vLLM load (--format hf)",
               "kvviz.cli.server_cli:add_export_arguments", "kvviz.cli.server_cli:run_export"),
    Subcommand("watch", "a running vLLM / SGLang / llama.cpp server's KV cache and queues, from its /metrics",
               "kvviz.cli.server_cli:add_watch_arguments", "kvviz.cli.server_cli:run_watch"),
    Subcommand("serve-bench", "many requests at once: the serving engine's scheduler over one paged pool",
               "kvviz.cli.serve_cli:add_serve_arguments", "kvviz.cli.serve_cli:run_serve"),
)


def resolve(ref: str) -> Callable[..., Any]:
    """"module:function" -> the function (imported now)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _run(cmd: Subcommand, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    run = resolve(cmd.run)
    if cmd.serves:
        return int(run(args))
    obj, text = run(args, parser) if cmd.with_parser else run(args)
    _emit(args, obj, text)
    if cmd.partial_error and "error" in obj:  # a later turn failed: the answered turns are out, then exit 2
        raise KVVizError(f"{obj['error']} (the {len(obj['turns'])} turn(s) before it are printed above)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvviz import __version__

    parser = argparse.ArgumentParser(prog="kvviz", description="See how an LLM generates text, and why the KV cache matters.")
    parser.add_argument("--version", action="version", version=f"kvviz {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in SUBCOMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help)
        resolve(cmd.add)(p)
        p.set_defaults(func=partial(_run, cmd))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    try:
        return args.func(args, sub)
    except ResultsNotSaved as e:  # the work is done: its results go to stdout, then the error
        print(e.text, end="" if e.text.endswith("\n") else "\n", flush=True)
        sub.error(str(e))
    except KVVizError as e:
        sub.error(str(e))  # prints usage + "kvviz <cmd>: error: ..." and exits 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `python -m kvviz ... | head`: the reader left; that is not an error worth a traceback.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0
