"""``python -m kvviz chat``: a conversation over one cache that lives across turns.

Each ``--turn`` is one user message; the answer is decoded on the same cache, and every turn
reports what it reused and what it prefilled (``kvviz.engine.sessions.conversation``).
"""
from __future__ import annotations

import argparse
from typing import Any

import kvviz.cli.argtypes as types
from kvviz.cli.request_args import add_sampling_arguments, sampling_from_args
from kvviz.errors import KVVizError


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="an instruct model with a chat template (default smollm2)")
    p.add_argument("--turn", action="append", required=True, metavar="TEXT",
                   help="one user message; repeat for every turn, in order")
    p.add_argument("--system", default=None, help="a system prompt (default: the template's own)")
    p.add_argument("--parse-special", action="store_true",
                   help="read special-token text typed in --turn/--system (<|im_end|>...) as control tokens; by "
                        "default it is plain text, so a message cannot end its turn or forge another")
    p.add_argument("--timestamp", action="store_true",
                   help="start the system prompt with the current time (every turn then misses the cache)")
    p.add_argument("--cache", choices=["static", "concat", "paged"], default="paged")
    p.add_argument("--block-size", type=types.kv_block_size, default=16, help="tokens per block of the paged cache")
    p.add_argument("--blocks", type=types.kv_blocks, default=None,
                   help="blocks in the paged pool (default: two contexts' worth)")
    add_sampling_arguments(p)
    p.add_argument("--max-new-tokens", type=types.token_count, default=64)
    p.add_argument("--check", action="store_true",
                   help="also generate every turn from scratch and measure the TTFT of recomputing it all")
    p.add_argument("--no-fast", action="store_true", help="run the readable model, without kvviz.fast")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json", action="store_true")


def run_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[dict[str, Any], str]:
    from kvviz.engine.generation.valid_request import CacheSpec
    from kvviz.engine.sessions.conversation import Conversation
    from kvviz.engine.loaded import load_model

    sampling = sampling_from_args(args, parser)
    empty = [i + 1 for i, t in enumerate(args.turn) if not t.strip()]
    if empty:
        raise KVVizError(f"turn {empty[0]} is empty: every --turn needs text")
    if args.cache != "paged" and args.blocks is not None:
        parser.error("--blocks applies to --cache paged")
    model = load_model(args.model, device=args.device)
    conv = Conversation(model, cache=CacheSpec(kind=args.cache, block_size=args.block_size, blocks=args.blocks),
                        sampling=sampling, system=args.system, timestamp=args.timestamp,
                        max_new_tokens=args.max_new_tokens, backend="readable" if args.no_fast else "fast",
                        parse_special=args.parse_special)
    conv.warm_up()  # turn 1's TTFT then times the model, not first-call costs
    turns, lines = [], []
    error = None
    for i, text in enumerate(args.turn):
        try:
            t = conv.send(text)
        except KVVizError as e:
            if not turns:  # nothing to keep: the plain error
                raise KVVizError(f"turn {i + 1}: {e}") from None
            # The turns already answered are printed with the error (nothing is lost): _cmd_chat
            # prints them, then exits with the error like any other.
            error = f"turn {i + 1}: {e}"
            lines += [f"> {text}", f"error: {error}", ""]
            break
        d = t.to_dict()
        if args.check:
            d["matches_scratch"] = conv.matches_scratch(i)
            d["recompute_ttft_ms"] = conv.recompute_ttft_ms(i)
        turns.append(d)
        lines += [f"> {text}", t.text,
                  f"  [{t.prompt_tokens} prompt tokens: {t.reused_tokens} reused, {t.prefilled_tokens} prefilled; "
                  f"{t.generated_tokens} generated; TTFT {t.ttft_ms:.1f} ms; cache {t.cache_bytes_used:,} B"
                  + (f"; {t.blocks_used} blocks, {t.blocks_shared} shared" if t.blocks_used is not None else "")
                  + "]", ""]
    obj: dict[str, Any] = {
        "model": model.name, "device": str(model.device), "cache": args.cache,
        "block_size": args.block_size if args.cache == "paged" else None,
        "engine": "fast" if not args.no_fast and model.fast is not None else "readable",
        "turns": turns,
    }
    if error is not None:
        obj["error"] = error
    if args.cache == "paged":
        obj["pool"] = conv.cache.stats().to_dict()  # type: ignore[attr-defined]
    return obj, "\n".join(lines).rstrip()
