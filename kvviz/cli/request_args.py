"""The request objects built from command-line flags, in one place for ``generate`` and ``chat``.

The sampling flags (``--greedy --temperature --top-k --top-p --seed``) are declared once here and
turned into one ``SamplingParams``; ``generate``'s cache and strategy flags into a ``CacheSpec`` and a
``Beam`` or ``Speculative``. The engine is imported when a command runs, never by ``--help``.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import kvviz.cli.argtypes as types
from kvviz.cli.argtypes import finite_float
from kvviz.cli.kv_cli import kv_options
from kvviz.errors import KVVizError

if TYPE_CHECKING:
    from kvviz.engine.generation.sampling import SamplingParams
    from kvviz.engine.generation.valid_request import Beam, CacheSpec, Speculative


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """--greedy | --temperature, --top-k, --top-p, --seed."""
    samp = p.add_mutually_exclusive_group()
    samp.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    samp.add_argument("--temperature", type=finite_float, help="sample at this temperature")
    p.add_argument("--top-k", type=types.top_k)
    p.add_argument("--top-p", type=finite_float)
    p.add_argument("--seed", type=types.seed, default=0)


def sampling_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> "SamplingParams":
    """The sampler the flags ask for: greedy unless --temperature is given (then --top-k/--top-p
    apply); ``--ignore-eos`` where the command has it."""
    from kvviz.engine.generation.sampling import SamplingParams

    if (args.top_k is not None or args.top_p is not None) and args.temperature is None:
        parser.error("--top-k and --top-p need --temperature")
    return SamplingParams(greedy=None if args.temperature is not None else True, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          ignore_eos=bool(getattr(args, "ignore_eos", False)))


def cache_from_args(args: argparse.Namespace) -> "CacheSpec":
    """``generate``'s cache: --no-cache, --cache-kind, --block-size and the compressed-KV flags."""
    from kvviz.engine.generation.valid_request import CacheSpec

    return CacheSpec(use_cache=not args.no_cache, kind=args.cache_kind, block_size=args.block_size,
                     **kv_options(args))


def strategy_from_args(args: argparse.Namespace) -> "Beam | Speculative | None":
    """``generate``'s strategy: --speculative, else beam search when --num-beams (or a beam flag) is given."""
    from kvviz.engine.generation.valid_request import Beam, Speculative

    if args.speculative is not None and args.num_beams != 1:
        raise KVVizError("choose beam search (num_beams > 1) or speculative decoding, not both")
    if args.speculative is not None:
        return Speculative(args.speculative, draft_tokens=args.draft_tokens, ngram=args.ngram)
    beam: dict[str, Any] = dict(length_penalty=args.length_penalty, early_stopping=args.early_stopping,
                                num_return_sequences=args.num_return_sequences)
    return Beam(args.num_beams, **beam)
