"""The bounds every entry point shares: the CLI's argument types (kvviz/cli/argtypes.py) refuse a value
past them before any work, and the engine checks the same numbers for API callers.

Pure Python, no torch: argparse, the calculator and the engine all import it. Each bound is where a
larger value stops being an experiment and starts being a crash, a hang or an allocation the
machine cannot hold (the reason is on its line).
"""
from __future__ import annotations

MAX_BEAMS = 64  # each beam is a row of the KV cache; beyond this the cache outgrows a laptop
MAX_DRAFT = 64  # drafted tokens verified per forward (prompt lookup)
MAX_NGRAM = 16  # the longest n-gram prompt lookup matches
MAX_KV_BLOCK_SIZE = 4096  # tokens per paged block (vLLM uses 16)
DEFAULT_KV_BLOCK_SIZE = 16  # vLLM's default; here so the request objects (no torch) and the paged cache share it
MAX_KV_BLOCKS = 1 << 20  # blocks in a paged pool; the pool's bytes are checked against memory too
MAX_SINKS = 1024  # StreamingLLM keeps 4
MAX_TOKENS = 1 << 20  # any token count (new tokens, windows, prompt lengths): past every supported context
MAX_TOKEN_ID = 1 << 21  # no supported vocabulary is larger (engine/models/llama.py MAX_VOCAB)
MAX_HEAD_DIM = 1024  # a quantization group lies within one head vector
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_REPEATS = 100  # timed runs of a benchmark (the docs' figures use 3-5): a billion ran for ever
MAX_SWEEP_POINTS = 32  # token counts in one bench --cache-sweep
MAX_BINS = 4096  # position bins of a curve
MAX_INT = 2**62  # the backstop for any other count: past it int64 tensors overflow
