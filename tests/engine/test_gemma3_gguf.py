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

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Six layers: five sliding (window 8) and one global, as Gemma 3's pattern has it; MQA.
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + \
    ["\u2581", *"abcdefghij", "\u2581a", "ab", "\u2581ab", "<start_of_turn>", "\n\n"]
TYPES = [3, 3, 3, 3] + [6] * 256 + [1] * 14 + [3, 4]
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}
QTYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0, "ffn_gate": Q.Q5_0,
          "ffn_up": Q.Q5_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}


def hf_tiny() -> Any:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, sliding_window=8, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zeros at init: give the (1 + w) scales something to do
                p.copy_(0.3 * torch.randn(p.shape))
    return model


def write_gemma3_gguf(path: Path, hf: Any, skip: str = "", tokenizer: bool = True) -> Path:
    """``hf`` as llama.cpp's converter writes it; ``skip`` leaves out a tensor, ``tokenizer=False`` the vocabulary."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, val in [("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_attention_heads), ("attention.head_count_kv", c.num_key_value_heads),
                     ("attention.key_length", c.head_dim), ("attention.value_length", c.head_dim),
                     ("attention.sliding_window", c.sliding_window)]:
        w.add_uint32("gemma3." + key, val)
    w.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32("gemma3.vocab_size", len(TOKENS))
    if tokenizer:
        w.add_tokenizer_model("llama")
        w.add_token_list(TOKENS)
        w.add_token_scores([-float(i) for i in range(len(TOKENS))])
        w.add_token_types(TYPES)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output matrix
        arr = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            arr = arr + 1.0  # llama.cpp's Gemma converter stores 1 + w
        if name == "model.embed_tokens.weight":
            short, gname = "token_embd", "token_embd.weight"
        elif name == "model.norm.weight":
            short, gname = "output_norm", "output_norm.weight"
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            short = _LAYER[rest.removesuffix(".weight")]
            gname = f"blk.{i}.{short}.weight"
        if gname == skip:
            continue
        qtype = QTYPES.get(short, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
        run = kvviz.generate(ours, prompt_ids=ids[0].tolist(), max_new_tokens=16, ignore_eos=True, **kw)
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
    bare = kvviz.load_model(str(write_gemma3_gguf(tmp_path / "bare.gguf", hf, tokenizer=False)))
    assert not bare.has_tokenizer and len(kvviz.generate(bare, prompt_ids=[5, 6], max_new_tokens=3).generated_ids) == 3
