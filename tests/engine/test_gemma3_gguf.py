"""A tiny random Gemma 3 written as llama.cpp's converter writes one (norms stored as 1 + w, no
Q/K permutation, F32 / Q8_0 / Q5_0 tensors), read by kvviz and by transformers' GGUF loader."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvviz
from kvviz.engine.loading.gguf_lite import read_gguf

from gguf_writers import GEMMA3_TOKENS, hf_tiny_gemma3, write_gemma3_gguf
from keyword_sets import request_kwargs

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
TOKENS = GEMMA3_TOKENS


def hf_tiny() -> Any:
    return hf_tiny_gemma3(seed=0)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_gguf(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf", hf_tiny())


def test_lite_reader_equals_gguf_reader(tiny_file: Path) -> None:
    lite, ref = read_gguf(tiny_file), gguf.GGUFReader(tiny_file)
    assert set(lite.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, value in lite.metadata.items():
        want = ref.fields[key].contents()
        got = value.tolist() if isinstance(value, np.ndarray) else value
        assert got == (want.tolist() if isinstance(want, np.ndarray) else want), key
    assert [t.name for t in lite.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(lite.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(reversed(b.shape.tolist()))
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name


def test_tiny_gemma3_gguf_equals_transformers(tiny_file: Path) -> None:
    ours = kvviz.load_model(str(tiny_file))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name,
                                                           dtype=torch.float32).eval()
    ref = hf.state_dict()
    for k, v in ours.model.state_dict().items():
        assert torch.equal(v, ref[k]), k
    ids = torch.randint(4, len(TOKENS), (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(ours.model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
        want = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, 30:].tolist()
    for kw in ({"cache_kind": "static"}, {"cache_kind": "paged"}, {"use_cache": False}):
        run = kvviz.generate(ours,
                             **request_kwargs(prompt_ids=ids[0].tolist(), max_new_tokens=16, ignore_eos=True, **kw))
        assert run.generated_ids == want, kw
    # The tokenizer from the same file: control and user-defined pieces whole, bigram merges, bytes.
    tok = transformers.AutoTokenizer.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name)
    for text in ("ab abba <start_of_turn>a\n\n\nb", " a  ab€"):
        assert ours.tokenizer.encode(text) == tok(text).input_ids, text


def test_damaged_or_partial_files(tmp_path: Path) -> None:
    hf = hf_tiny()
    missing = write_gemma3_gguf(tmp_path / "missing.gguf", hf, skip="blk.3.attn_k_norm.weight")
    with pytest.raises(kvviz.KVVizError, match=r"missing\.gguf is missing tensors: model\.layers\.3\.self_attn\.k_norm"):
        kvviz.load_model(str(missing))
    full = write_gemma3_gguf(tmp_path / "full.gguf", hf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:-1000])
    with pytest.raises(kvviz.KVVizError, match="truncated"):
        kvviz.load_model(str(cut))
    # a NaN block scale: the Q8_0 block's 32 weights are NaN, refused at load with the tensor named
    nan = tmp_path / "nan.gguf"
    data = bytearray(full.read_bytes())
    at = next(t for t in gguf.GGUFReader(full).tensors if t.name == "blk.0.attn_q.weight").data_offset
    data[at:at + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    nan.write_bytes(bytes(data))
    with pytest.raises(kvviz.KVVizError, match=r"nan\.gguf is damaged: model\.layers\.0\.self_attn\.q_proj\.weight "
                                               r"holds 32 NaN and 0 infinite values"):
        kvviz.load_model(str(nan))
    bare = kvviz.load_model(str(write_gemma3_gguf(tmp_path / "bare.gguf", hf, tokenizer=False)))
    assert not bare.has_tokenizer and len(kvviz.generate(bare, prompt=[5, 6], max_new_tokens=3).generated_ids) == 3
