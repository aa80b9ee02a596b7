"""GGUF files of every Llama-kin family kvviz reads (llama, qwen2, qwen3, and Mistral: llama with a
sliding window), written tiny and random with gguf.GGUFWriter the way llama.cpp's converter writes
them, loaded by kvviz and by transformers' own GGUF loader: same logits, same greedy tokens,
cached and uncached, readable model and accelerator. Other architectures are refused in one line.

The seeds in SEEDS were not used while the code was written (it was developed on seeds 0 and 3).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.engine.core.step import run_step
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.api import generate
from kvviz.engine.loading.gguf_llama import load_gguf
from kvviz.engine.loading.gguf_checks import SUPPORTED_LIST, model_family
from kvviz.engine.loaded import load_model
from kvviz.errors import KVVizError
from kvviz.fast import build as build_fast

from gguf_writers import Q, write_bpe_tokenizer_gguf, write_llama_gguf
from kvviz import CacheSpec, SamplingParams

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SEEDS = (11, 12)  # held out: never run while the code was written (developed on seeds 0 and 3)
PROMPT = [3, 14, 15, 92, 65]
STEPS = 10
# hidden 64, 4 query heads sharing 2 K/V heads (GQA); head_dim 32 != 64 / 4 where the family allows.
BASE: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                            rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    # transformers' Qwen2 has head_dim = hidden / heads; its q/k/v carry biases.
    "qwen2": dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
    # transformers' GGUF loader ignores qwen3.attention.key_length and takes Qwen3's 128.
    "qwen3": dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 30000.0}),
    # a window of 6: the 5-token prompt fits, the decode steps slide past it
    "mistral": dict(head_dim=32, sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}
HF_CONFIG = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}
def make_hf(family: str, seed: int, **overrides: Any) -> Any:
    torch.manual_seed(seed)
    cfg = getattr(transformers, HF_CONFIG[family])(**{**BASE, **FAMILIES[family], **overrides})
    hf = getattr(transformers, HF_CLASS[family])(cfg)
    with torch.no_grad():
        hf.model.norm.weight.mul_(10.0)  # spread the logits: greedy ties are then out of reach
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(0.0, 0.5)  # zero biases and unit norms would test nothing
    return hf.eval()


def write_gguf(path: Path, hf: Any, family: str, arch: str | None = None, f16: bool = False,
               extra: dict[str, Any] | None = None) -> Path:
    """``hf`` as llama.cpp writes it: Mistral as arch llama (+ its window), q/k permuted for llama
    only (llama.cpp runs Qwen with NeoX RoPE, the halves of a head, as transformers does)."""
    arch = arch or ("llama" if family == "mistral" else family)
    return write_llama_gguf(path, hf, arch, name=f"{family}-tiny", matrix_type=Q.F16 if f16 else None, extra=extra,
                            window=hf.config.sliding_window if family == "mistral" else None)


def hf_from_gguf(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def mistral_over(llama: Any, config: Any) -> Any:
    """transformers' Mistral (``config``, its window) holding the weights of a loaded Llama."""
    out = transformers.MistralForCausalLM(config)
    missing, unexpected = out.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head follows the embedding
    return out.eval()


def hf_greedy(hf: Any, prompt: list[int], steps: int, use_cache: bool = True) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, use_cache=use_cache,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=[(f, s) for f in ("llama", "qwen2", "qwen3", "mistral") for s in SEEDS],
                ids=lambda fs: f"{fs[0]}-seed{fs[1]}")
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Path]:
    family, seed = request.param
    hf = make_hf(family, seed, tie_word_embeddings=seed % 2 == 0)  # one seed tied, one with output.weight
    path = write_gguf(tmp_path_factory.mktemp(family) / f"{family}-{seed}.gguf", hf, family, f16=seed % 2 == 1)
    return family, hf, path


def test_config_comes_from_the_header(case: tuple[str, Any, Path]) -> None:
    family, hf, path = case
    c = load_gguf(path).config
    hc = hf.config
    assert (c.family, c.n_layer, c.n_head, c.kv_heads, c.n_embd) == (
        family, hc.num_hidden_layers, hc.num_attention_heads, hc.num_key_value_heads, hc.hidden_size)
    assert c.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert c.rope_theta == hc.rope_parameters["rope_theta"]
    assert (c.qkv_bias, c.qk_norm) == (family == "qwen2", family == "qwen3")
    assert c.sliding_window == (6 if family == "mistral" else None)
    assert c.tie_word_embeddings == hc.tie_word_embeddings


def test_logits_and_greedy_equal_transformers(case: tuple[str, Any, Path]) -> None:
    """kvviz's readable model and its accelerator (where it takes the family) against transformers
    loading the same file: logits of a 12-token sequence, then 10 greedy tokens cached and not."""
    family, hf, path = case
    ref = hf_from_gguf(path)
    m = load_model(str(path), device="cpu")
    assert m.name == path.stem and m.info["family"] == family
    idx = torch.tensor([PROMPT + [7, 1, 60, 33, 2, 95, 48]])
    if family == "mistral":
        # transformers' GGUF loader drops llama.attention.sliding_window and loads this file as
        # its Llama, every layer full (a general.name of exactly "mistral" would pick its Mistral,
        # which gguf-py cannot map: NotImplementedError). Within the window the two agree; past
        # it the reference is transformers' Mistral with the header's window over the file's
        # weights, as transformers' GGUF loader dequantized them.
        assert type(ref).__name__ == "LlamaForCausalLM" and getattr(ref.config, "sliding_window", None) is None
        with torch.inference_mode():
            torch.testing.assert_close(m.model(idx[:, :6]), ref(idx[:, :6]).logits, atol=1e-4, rtol=1e-4)
            assert not torch.allclose(m.model(idx)[:, 6:], ref(idx).logits[:, 6:], atol=1e-2)
        ref = mistral_over(ref, hf.config)
    with torch.inference_mode():
        want = ref(idx).logits
        torch.testing.assert_close(m.model(idx), want, atol=1e-4, rtol=1e-4)
        if m.fast is not None:
            torch.testing.assert_close(m.fast.forward(idx, torch.arange(idx.shape[1])), want, atol=1e-4, rtol=1e-4)
    greedy = hf_greedy(ref, PROMPT, STEPS)
    assert greedy == hf_greedy(ref, PROMPT, STEPS, use_cache=False)
    for use_cache in (True, False):
        for fast in (True, False):
            run = generate(m, prompt=PROMPT, max_new_tokens=STEPS, backend="fast" if fast else "readable",
                           sampling=SamplingParams(greedy=True), cache=CacheSpec(use_cache=use_cache))
            assert run.generated_ids == greedy, (use_cache, fast)


def test_accelerator_takes_what_it_computes_exactly(case: tuple[str, Any, Path]) -> None:
    """llama and qwen2 (biases on q/k/v) run in the accelerator; qwen3's q/k norms and Mistral's
    window are not in it, so it declines and the readable model runs."""
    family, _, path = case
    m = load_model(str(path), device="cpu")
    assert (m.fast is not None) == (family in ("llama", "qwen2"))
    if m.fast is None:
        assert build_fast(m.model) is None
        return
    # The one-row decode step (the whole step in one call into C on a static cache), step by step
    # against the readable model on a cache of its own.
    ours, ref = (make_cache("static", m.config, 1, "cpu", torch.float32) for _ in range(2))
    ids = torch.tensor([PROMPT + [7, 1, 60, 33, 2, 95, 48]])
    with torch.inference_mode():
        for t in range(ids.shape[1]):
            tok, pos = ids[:, t:t + 1], torch.tensor([t])
            torch.testing.assert_close(m.fast.forward(tok, pos, ours), m.model(tok, pos, ref), atol=1e-4, rtol=1e-4)
            ours.advance(1)
            ref.advance(1)


def test_mistral_window_in_chunks_and_in_every_cache_kind(tmp_path: Path) -> None:
    """A window of 3 over a 12-token prompt, fed at once, in chunks of 5 and token by token,
    through every cache kind: the mask must hide the same keys every way (transformers' Mistral
    with that window as the reference)."""
    hf = make_hf("mistral", SEEDS[0], sliding_window=3)
    m = load_model(str(write_gguf(tmp_path / "m3.gguf", hf, "mistral")), device="cpu")
    assert m.config.sliding_window == 3 and m.fast is None
    ids = PROMPT + [7, 1, 60, 33, 2, 95, 48]
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0]  # (12, V)
        for kind in ("static", "concat", "paged"):
            for chunk in (12, 5, 1):
                cache = make_cache(kind, m.config, 1, "cpu", torch.float32)
                got = []
                for at in range(0, len(ids), chunk):
                    piece = torch.tensor([ids[at:at + chunk]])
                    got.append(run_step(m, cache, piece, torch.arange(at, at + piece.shape[1]), backend="readable",
                                        last_only=False, hash_ids=False)[0])
                torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4, msg=f"{kind} {chunk}")
    greedy = hf_greedy(hf, ids, STEPS)
    for kind in ("static", "concat", "paged"):
        run = generate(m, prompt=ids, max_new_tokens=STEPS, sampling=SamplingParams(greedy=True),
                       cache=CacheSpec(kind=kind))
        assert run.generated_ids == greedy, kind


def test_a_windowed_cache_on_a_sliding_model_is_refused(tmp_path: Path) -> None:
    m = load_model(str(write_gguf(tmp_path / "m.gguf", make_hf("mistral", SEEDS[0]), "mistral")), device="cpu")
    with pytest.raises(KVVizError, match="already slides its own window of 6 positions"):
        generate(m, prompt=PROMPT, max_new_tokens=2, sampling=SamplingParams(greedy=True), cache=CacheSpec(window=8))


@pytest.mark.parametrize("arch", ["phi3", "falcon", "gpt2"])
def test_other_architectures_are_refused_in_one_line(tmp_path: Path, arch: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The API raises one KVVizError line naming the list; the CLI prints it as its error line, exit 2."""
    from kvviz.cli.main import main

    path = write_gguf(tmp_path / f"{arch}.gguf", make_hf("llama", 0), "llama", arch=arch)
    with pytest.raises(KVVizError) as e:
        load_model(str(path), device="cpu")
    msg = str(e.value)
    assert msg == f"GGUF architecture {arch!r} is not supported; kvviz reads {SUPPORTED_LIST}"
    assert "\n" not in msg and SUPPORTED_LIST == "llama, qwen2, qwen3, gemma3 (mistral = llama with a sliding window)"
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"kvviz generate: error: {msg}\n" in err and "Traceback" not in err


def test_a_qwen_file_missing_its_biases_names_them(tmp_path: Path) -> None:
    """A qwen2 header over a Llama's tensors (no q/k/v biases): the missing tensors are named."""
    path = write_gguf(tmp_path / "nobias.gguf", make_hf("llama", 0), "llama", arch="qwen2")
    with pytest.raises(KVVizError, match="nobias.gguf is missing tensors: model.layers.0.self_attn.q_proj.bias"):
        load_gguf(path)


def test_ggufs_dropped_in_models_are_offered_named_and_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app lists the .gguf files directly in its models folder (no path outside it), names each
    by the family its header says, says why a foreign or damaged one cannot load, and loads one."""
    from kvviz.ui.state import model_menu

    root = tmp_path / "models"
    root.mkdir()
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        write_gguf(root / f"{family}.gguf", make_hf(family, 0), family)
    write_gguf(root / "phi.gguf", make_hf("llama", 0), "llama", arch="phi3")
    (root / "junk.gguf").write_bytes(b"not a gguf")
    (root / ".hidden.gguf").write_bytes(b"GGUF")
    outside = tmp_path / "outside.gguf"
    write_gguf(outside, make_hf("llama", 0), "llama")
    os.symlink(outside, root / "escape.gguf")
    os.mkfifo(root / "fifo.gguf")
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(root))
    names = ["junk.gguf", "llama.gguf", "mistral.gguf", "phi.gguf", "qwen2.gguf", "qwen3.gguf"]
    assert model_menu.list_model_ggufs() == names
    assert [c for c in model_menu.model_choices() if c.startswith("gguf:")] == ["gguf:" + n for n in names]
    labels = {n: model_menu.choice_label("gguf:" + n) for n in names}
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        assert labels[f"{family}.gguf"].startswith(f"gguf:{family}.gguf ({family}, ") and "KiB)" in labels[f"{family}.gguf"]
    assert model_family(root / "mistral.gguf") == "mistral"
    assert labels["phi.gguf"] == f"gguf:phi.gguf (unreadable: GGUF architecture 'phi3' is not supported; kvviz reads {SUPPORTED_LIST})"
    assert labels["junk.gguf"].startswith("gguf:junk.gguf (unreadable: junk.gguf is not a GGUF file")
    for bad in ("escape.gguf", "fifo.gguf", ".hidden.gguf", "../outside.gguf", "/etc/passwd", "x/../llama.gguf"):
        with pytest.raises(KVVizError):
            model_menu.spec_for("gguf:" + bad)
    spec = model_menu.spec_for("gguf:qwen2.gguf")
    assert spec == str((root / "qwen2.gguf").resolve())
    m = load_model(spec, device="cpu")
    assert m.config.family == "qwen2" and m.name == "qwen2"
    with pytest.raises(KVVizError, match="not supported; kvviz reads llama, qwen2, qwen3, gemma3"):
        load_model(model_menu.spec_for("gguf:phi.gguf"), device="cpu")


def test_weight_bytes_flops_and_the_bench_baseline_know_each_family(case: tuple[str, Any, Path]) -> None:
    """The analytic weight bytes equal the loaded parameters (biases and q/k norms included); the
    attention FLOPs count at most W keys per query under a window (summed by hand here); the
    bench's transformers baseline is the family's own class and gives kvviz's logits."""
    from kvviz.engine.generation.flops import forward_flops, weight_bytes
    from kvviz.measure.bench import _hf_llama

    family, _, path = case
    m = load_model(str(path), device="cpu")
    c = m.config
    assert weight_bytes(c, 4) == 4 * m.num_params
    qd = c.n_head * c.head_dim
    for start, T in ((0, 12), (3, 1), (9, 1), (4, 5)):
        keys = sum(min(start + i + 1, c.sliding_window or 10**9) for i in range(T))
        full = sum(start + i + 1 for i in range(T))
        assert forward_flops(c, T, start) - forward_flops(type(c)(**{**c.to_dict(), "sliding_window": None}), T, start) \
            == c.n_layer * 4 * qd * (keys - full)
    hf = _hf_llama(m)
    assert type(hf).__name__ == HF_CLASS[family]
    idx = torch.tensor([PROMPT + [7, 1, 60, 33, 2, 95, 48]])
    with torch.inference_mode():
        torch.testing.assert_close(m.model(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


# A Q4_K_M-like mix of every block type beyond the legacy ones: gguf cannot quantize the K types,
# so gguf_writers writes random blocks for them and the file, not ``hf``, is the model.
K_TYPES = {"token_embd": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0,
           "ffn_gate": Q.Q5_1, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K, "output": Q.Q6_K}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_k_quant_files_equal_transformers(tmp_path: Path, family: str) -> None:
    """A llama, qwen2 or qwen3 file of Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 matrices (rows of 256: a K block's
    width) read by kvviz and by transformers' GGUF loader: equal weights, logits, greedy tokens."""
    shape = dict(hidden_size=256, intermediate_size=512, **({"head_dim": 64} if family == "llama" else {}))
    hf = make_hf(family, SEEDS[0], tie_word_embeddings=family == "qwen2", **shape)  # qwen2: no output.weight
    path = write_llama_gguf(tmp_path / f"{family}-k.gguf", hf, family, types=K_TYPES)
    ref = hf_from_gguf(path)
    m = load_model(str(path), device="cpu")
    counts = m.info["tensor_types"]
    assert {k: counts.get(k) for k in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")} == {
        "Q4_K": 4, "Q5_K": 4, "Q6_K": 3 if family == "qwen2" else 4, "Q5_0": 2, "Q5_1": 2}
    ours, want = m.model.state_dict(), ref.state_dict()
    assert set(ours) == set(want)
    for k, v in want.items():
        assert torch.equal(ours[k], v), k  # bit for bit: both dequantize the same blocks
    idx = torch.tensor([PROMPT + [7, 1, 60, 33, 2, 95, 48]])
    with torch.inference_mode():
        torch.testing.assert_close(m.model(idx), ref(idx).logits, atol=1e-4, rtol=1e-4)
    greedy = hf_greedy(ref, PROMPT, STEPS)
    for fast in (True, False):
        assert generate(m, prompt=PROMPT, max_new_tokens=STEPS, backend="fast" if fast else "readable",
                        sampling=SamplingParams(greedy=True)).generated_ids == greedy


def test_qwen2_pre_tokenizer_equals_transformers(tmp_path: Path) -> None:
    """Qwen2/2.5/3 GGUFs name their split "qwen2" (Llama 3's, one digit per piece): a tiny byte-level
    BPE vocabulary with such a split gives transformers' GGUF tokenizer's ids on varied text."""
    from kvviz.engine.tokenize.gguf_bpe import load_gguf_tokenizer

    merges = ("Ġ t", "h e", "Ġt he", "1 2", "Ġ a", "i n", "Ġ 1", "' s", "Ċ Ċ")
    write_bpe_tokenizer_gguf(tmp_path / "q.gguf", pre="qwen2", arch="qwen2", merges=merges, control="<|endoftext|>")
    ours = load_gguf_tokenizer(tmp_path / "q.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="q.gguf")
    texts = ["the 12345 in a theatre, 12 and 1 2", "I'll  go\n\n  there's 1234567\tx IT'S",
             "héllo wörld ١٢٣ 東京 😀", "def f(x):\n    return x*2  # 12\n\n\n", "  lead and trail  ", "3.14159e-10"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode("12345") == [ord(c) for c in "12345"]  # one digit per piece: "12" is never merged
