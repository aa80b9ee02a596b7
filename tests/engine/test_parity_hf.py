"""Parity with Hugging Face transformers' GPT-2: logits, greedy generation, attention, export."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvviz
import kvviz.fast.gpt2_flat
import kvviz.fast.rowops
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loading.save import export_hf_gpt2

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402
from accel_checks import randomize
from kvviz import CacheSpec

VOCAB = 320  # > the 300-token BPE fixture, so its ids are all valid


def _hf_config(**overrides: Any) -> GPT2Config:
    kw: dict[str, Any] = dict(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=3, n_head=4,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return GPT2Config(**{**kw, **overrides})


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = GPT2LMHeadModel(_hf_config()).eval()
    randomize(model, 1)
    folder = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model.save_pretrained(folder)  # safetensors is the default (and only) format in transformers 5
    assert (folder / "model.safetensors").is_file() and not list(folder.glob("*.bin"))
    return folder


@pytest.fixture(scope="module")
def hf(hf_folder: Path) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(hf_folder).eval()


@pytest.fixture(scope="module")
def kv(hf_folder: Path) -> LoadedModel:
    return kvviz.load_model(hf_folder, device="cpu")


def _hf_greedy(hf: GPT2LMHeadModel, ids: list[list[int]], n: int, **kw: Any) -> list[list[int]]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor(ids), do_sample=False, max_new_tokens=n, min_new_tokens=0,
                          pad_token_id=0, **kw)
    return out[:, len(ids[0]):].tolist()


def test_logits_match_hf(hf: GPT2LMHeadModel, kv: LoadedModel) -> None:
    x = torch.randint(0, VOCAB, (4, 50), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = hf(x).logits
        got = kv.model(x)
    assert kv.config.n_layer == 3 and kv.config.vocab_size == VOCAB and kv.config.block_size == 128
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["static", "concat", "uncached"])
def test_greedy_generation_matches_hf_generate(hf: GPT2LMHeadModel, kv: LoadedModel, mode: str) -> None:
    for prompt in ([17], [5, 99, 250, 3, 3, 41, 300, 7, 12, 64]):
        want = _hf_greedy(hf, [prompt], 30)[0]
        run = kvviz.generate(kv, prompt=prompt, max_new_tokens=30,
                             cache=CacheSpec(use_cache=mode != "uncached", kind="static" if mode == "uncached" else mode))
        assert run.generated_ids == want
        assert len(set(want)) >= 5  # not a degenerate constant sequence


@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("mode", ["static", "concat"])
def test_one_row_decode_matches_hf_at_two_threads(hf: GPT2LMHeadModel, kv: LoadedModel, mode: str,
                                                  threads: int) -> None:
    """Two threads: every decode step takes the fused C row ops (kvviz.fast.rowops) where they build,
    each logit within float tolerance of transformers."""
    assert (kv.fast.plan().rows is not None) == (kvviz.fast.rowops.load() is not None)
    prompt = [5, 99, 250, 3, 3, 41, 300, 7, 12, 64]
    want = _hf_greedy(hf, [prompt], 30)[0]
    run = kvviz.generate(kv, prompt=prompt, max_new_tokens=30, capture=kvviz.Capture(logits=True),
                         cache=CacheSpec(kind=mode))
    assert run.generated_ids == want
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + want])).logits[0]  # (T, V)
    got = np.stack([e.logits for e in run.events])  # (30, V): the logits each step sampled from
    n = len(prompt)
    np.testing.assert_allclose(got, ref[n - 1:n + 29].numpy(), atol=2e-5, rtol=1e-5)


def test_batched_greedy_matches_hf(hf: GPT2LMHeadModel, kv: LoadedModel) -> None:
    rows = [[1, 2, 3, 4, 5, 6], [200, 100, 50, 25, 12, 6], [7, 7, 7, 7, 7, 7]]
    want = _hf_greedy(hf, rows, 12)
    run = kvviz.generate(kv, prompt=rows, max_new_tokens=12)
    assert [[e.token_ids[b] for e in run.events] for b in range(3)] == want


def test_captured_attention_matches_hf_eager(hf_folder: Path, kv: LoadedModel) -> None:
    eager = GPT2LMHeadModel.from_pretrained(hf_folder, attn_implementation="eager").eval()
    prompt = [11, 22, 33, 44, 55, 66, 77]
    for use_cache in (True, False):
        run = kvviz.generate(kv, prompt=prompt, max_new_tokens=6, capture=kvviz.Capture(attention=True),
                             cache=CacheSpec(use_cache=use_cache))
        ids = prompt + run.generated_ids
        for s, e in enumerate(run.events):
            t = len(prompt) + s
            with torch.inference_mode():
                out = eager(torch.tensor([ids[:t]]), output_attentions=True)
            want = torch.stack([a[0, :, -1, :] for a in out.attentions])  # (L, nh, t)
            assert e.attn.shape == tuple(want.shape)
            np.testing.assert_allclose(e.attn.astype(np.float32), want.numpy(), atol=2e-3, rtol=0)


def test_eos_stops_like_hf(hf_folder: Path, hf: GPT2LMHeadModel, tmp_path: Path) -> None:
    prompt = [5, 99, 250, 3, 3, 41, 300, 7, 12, 64]
    ref = _hf_greedy(hf, [prompt], 30)[0]
    k = max(i for i in range(30) if ref[i] not in ref[:i])  # the latest first appearance
    assert k >= 3
    folder = tmp_path / "with-eos"
    shutil.copytree(hf_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = ref[k]
    (folder / "config.json").write_text(json.dumps(cfg))
    want = _hf_greedy(hf, [prompt], 30, eos_token_id=ref[k])[0]
    assert want == ref[: k + 1]
    m = kvviz.load_model(folder, device="cpu")
    run = kvviz.generate(m, prompt=prompt, max_new_tokens=30)
    assert (run.stop_reason, run.generated_ids) == ("eos", want)


def test_folder_with_tokenizer_json(hf_folder: Path, hf: GPT2LMHeadModel, bpe_tokenizer_json: Path,
                                    tmp_path: Path) -> None:
    folder = tmp_path / "with-tokenizer"
    shutil.copytree(hf_folder, folder)
    shutil.copy(bpe_tokenizer_json, folder / "tokenizer.json")
    m = kvviz.load_model(folder, device="cpu")
    assert m.has_tokenizer and m.tokenizer.vocab_size == 300
    text = "To be, or not to be"
    ids = m.tokenizer.encode(text)
    assert m.tokenizer.decode(ids) == text and len(ids) < len(text)
    run = kvviz.generate(m, prompt=text, max_new_tokens=20)
    assert list(run.prompt_ids) == ids and run.prompt_text == text
    assert run.generated_ids == _hf_greedy(hf, [ids], 20)[0]
    assert run.text == m.tokenizer.decode(run.generated_ids)
    assert [e.token_text for e in run.events] == [m.tokenizer.token_display(i) for i in run.generated_ids]


def test_folder_without_tokenizer_takes_ids_only(kv: LoadedModel) -> None:
    assert not kv.has_tokenizer
    with pytest.raises(kvviz.KVVizError, match="tokenizer"):
        kvviz.generate(kv, prompt="hello", max_new_tokens=2)
    run = kvviz.generate(kv, prompt=[3, 4], max_new_tokens=2)
    assert run.events[0].token_text == f"<|{run.generated_ids[0]}|>"


def test_headless_gpt2model_folder_loads(tmp_path: Path) -> None:
    """GPT2Model checkpoints name tensors without the `transformer.` prefix."""
    base = GPT2Model(_hf_config(n_layer=2)).eval()
    randomize(base, 5)
    base.save_pretrained(tmp_path / "base")
    m = kvviz.load_model(tmp_path / "base", device="cpu")
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = base(x).last_hidden_state @ base.wte.weight.T  # GPT-2's head is tied to wte
        got = m.model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_untied_lm_head_is_not_silently_replaced(tmp_path: Path) -> None:
    """A checkpoint whose LM head differs from wte must load exactly or be refused, never mis-load."""
    untied = GPT2LMHeadModel(_hf_config(n_layer=2, tie_word_embeddings=False)).eval()
    randomize(untied, 6)
    assert not torch.equal(untied.lm_head.weight, untied.transformer.wte.weight)
    untied.save_pretrained(tmp_path / "untied")
    try:
        m = kvviz.load_model(tmp_path / "untied", device="cpu")
    except kvviz.KVVizError as e:
        assert "lm_head" in str(e) or "tie" in str(e)
        return
    x = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(m.model(x), untied(x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", ["tiny", "bias-free"])
def test_export_round_trip_through_transformers(shape: str, tmp_path: Path, make_model: Any) -> None:
    m = kvviz.load_model("random:tiny", device="cpu") if shape == "tiny" else make_model(bias=False, seed=8)
    export_hf_gpt2(m.model, tmp_path / "export")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(back(x).logits, m.model(x), atol=1e-5, rtol=1e-5)
    again = kvviz.load_model(tmp_path / "export", device="cpu")  # and kvviz reads its own export
    with torch.inference_mode():
        torch.testing.assert_close(again.model(x), m.model(x), atol=0, rtol=0)
    prompt = [72, 105, 33]
    assert kvviz.generate(m, prompt=prompt, max_new_tokens=15).generated_ids == _hf_greedy(back, [prompt], 15)[0]


def test_export_refuses_grouped_query_attention(make_model: Any, tmp_path: Path) -> None:
    with pytest.raises(kvviz.KVVizError, match="MHA"):
        export_hf_gpt2(make_model(n_kv_head=2).model, tmp_path / "gqa")
