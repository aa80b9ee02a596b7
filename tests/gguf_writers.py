"""Tiny GGUF files written as llama.cpp's converter writes them, for the tests of every GGUF path
(tests/engine/test_gguf*.py, test_gemma3_gguf.py, test_tokenizer_gguf.py, test_spm_llama.py,
tests/measure/test_bench.py).

One writer per kind of file: a Llama-family model (llama, Mistral = llama + window, qwen2, qwen3)
from a transformers model, a Gemma 3 model, and tokenizer-only files (byte-level BPE, a Llama
SentencePiece vocabulary). The files are written with ``gguf.GGUFWriter`` (llama.cpp's own
writer), never with kvviz's code, so what kvviz reads back is an independent reference.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# The bits a code streams in, by type: packed, Q8_0 one int8 a weight.
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}
# Bytes a weight the kernel streams, codes, scales and offsets, hand-computed from ggml's block
# structs: every type exactly its file size, as llama.cpp reads it. Legacy, per block of 32: Q4_1
# 16 bytes of nibbles + fp16 d + fp16 m = 20 / 32 = 0.625. K, per super-block of 256: Q4_K fp16 d,
# dmin + 12 bytes of 6-bit scales and mins + 128 of nibbles = 144 / 256 = 0.5625; Q5_K + 32 bytes of
# fifth bits = 176; Q6_K 128 + 64 bytes of codes + 16 int8 scales + fp16 d = 210 (0.8203125).
BYTES_PER_WEIGHT = {Q.Q4_0: 18 / 32, Q.Q4_1: 20 / 32, Q.Q5_0: 22 / 32, Q.Q5_1: 24 / 32, Q.Q8_0: 34 / 32,
                    Q.Q4_K: 144 / 256, Q.Q5_K: 176 / 256, Q.Q6_K: 210 / 256}

# transformers -> llama.cpp, inside blk.{i}: every Llama-family weight (Qwen2 biases, Qwen3 q/k norms).
LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (n_head already the K/V count for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_tensors(hf: Any, permute: bool = True) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names, fp32 numpy; q/k rows in llama.cpp's order when
    ``permute`` (llama files only: llama.cpp runs Qwen with NeoX RoPE, transformers' order)."""
    c = hf.config
    out: dict[str, np.ndarray] = {}
    for name, t in hf.state_dict().items():
        w = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:  # llama.cpp drops a tied output matrix
                out["output.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{rest}
            if permute and rest == "self_attn.q_proj.weight":
                w = llamacpp_permute(w, c.num_attention_heads)
            elif permute and rest == "self_attn.k_proj.weight":
                w = llamacpp_permute(w, c.num_key_value_heads)
            out[f"blk.{i}.{LLAMA_LAYER_NAMES[rest]}"] = w
    return out


# Where each K type keeps its fp16 fields in a block, and a value for them that gives weights of
# about N(0, 0.02)'s size: gguf has no quantizer for these types, so their blocks are random bytes.
# IQ4_NL (one fp16 scale, then 16 bytes of nibbles) is here for the tests of a type kvviz refuses.
_K_F16 = {Q.Q4_K: ((0, 2), 1e-4), Q.Q5_K: ((0, 2), 5e-5), Q.Q6_K: ((208,), 2e-5), Q.IQ4_NL: ((0,), 1e-3)}


def random_k_blocks(shape: tuple[int, ...], qtype: Any, seed: int) -> np.ndarray:
    """(rows, bytes per row) of random K-type blocks with small finite scales: a weight both
    readers must decode alike, whatever its values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, size), dtype=np.uint8)
    fields, scale = _K_F16[qtype]
    for at in fields:
        d = rng.uniform(0.5 * scale, scale, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8)
    return blocks.reshape(shape[0], -1)


def _add_tensor(w: Any, name: str, arr: np.ndarray, qtype: Any) -> None:
    if qtype == Q.F32:
        w.add_tensor(name, arr)
    elif qtype == Q.F16:
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype in _K_F16:  # arr gives the shape only
        seed = int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "little")
        w.add_tensor(name, random_k_blocks(arr.shape, qtype, seed), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def _finish(w: Any, path: Path) -> Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_llama_gguf(path: Path, hf: Any, arch: str = "llama", *, types: dict[str, Any] | None = None,
                     matrix_type: Any = None, name: str | None = None, window: int | None = None,
                     extra: dict[str, int] | None = None, eos: int | None = None, chat_template: str | None = None,
                     edit: Callable[[Any, dict[str, np.ndarray]], None] | None = None, spm: bool = False) -> Path:
    """``hf`` (a transformers Llama, Mistral, Qwen2 or Qwen3) as llama.cpp writes it, under ``arch``.

    types: a tensor's short name (``attn_q``) -> its quant type, for matrices (norms stay F32, as
    llama.cpp keeps them); matrix_type: the type of every other matrix (F32 when None); window: a
    Mistral's ``<arch>.attention.sliding_window``; extra: more u32 keys; ``edit(writer, tensors)``
    may add metadata or change tensors before they are written; spm: the Llama SentencePiece
    vocabulary (``add_spm_vocab``; ``hf``'s vocabulary must have its size) instead of bare names."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    if name is not None:
        w.add_name(name)
    p = arch + "."
    for key, val in [("block_count", c.num_hidden_layers), ("context_length", c.max_position_embeddings),
                     ("embedding_length", c.hidden_size), ("feed_forward_length", c.intermediate_size),
                     ("attention.head_count", c.num_attention_heads),
                     ("attention.head_count_kv", c.num_key_value_heads), ("vocab_size", c.vocab_size),
                     ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                     ("rope.dimension_count", head_dim)]:
        w.add_uint32(p + key, val)
    if window is not None:
        w.add_uint32(p + "attention.sliding_window", window)
    for key, val in (extra or {}).items():
        w.add_uint32(key, val)
    w.add_float32(p + "rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32(p + "attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    if spm:
        add_spm_vocab(w)
    else:
        w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    if eos is not None:
        w.add_eos_token_id(eos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    tensors = llama_tensors(hf, permute=arch == "llama")
    if edit is not None:
        edit(w, tensors)
    for gname, arr in tensors.items():
        short = gname.split(".")[-2]
        qtype = (types or {}).get(short, matrix_type or Q.F32) if arr.ndim == 2 else Q.F32
        _add_tensor(w, gname, arr, qtype)
    return _finish(w, path)


# --- Gemma 3 ----------------------------------------------------------------------------------------

# A SentencePiece vocabulary: specials, the 256 byte pieces, a few merges, a control and a
# user-defined piece.
GEMMA3_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + \
    ["\u2581", *"abcdefghij", "\u2581a", "ab", "\u2581ab", "<start_of_turn>", "\n\n"]
GEMMA3_TYPES = [3, 3, 3, 3] + [6] * 256 + [1] * 14 + [3, 4]
_GEMMA3_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                 "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA3_QTYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q8_0, "attn_output": Q.Q8_0, "ffn_gate": Q.Q5_0,
                 "ffn_up": Q.Q5_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0}


def hf_tiny_gemma3(seed: int = 0) -> Any:
    """A tiny random transformers Gemma 3 over GEMMA3_TOKENS: 6 layers (window 8), hidden 256, 4 heads
    of 64 over 1 K/V head, MLP 512, its norm weights random (zeros at init would hide the 1 + w)."""
    import torch
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(GEMMA3_TOKENS), hidden_size=256, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=8, max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn(p.shape))
    return model


def write_gemma3_gguf(path: Path, hf: Any, skip: str = "", tokenizer: bool = True,
                      types: dict[str, Any] | None = None) -> Path:
    """``hf`` (a transformers Gemma3ForCausalLM over GEMMA3_TOKENS) as llama.cpp's converter writes
    it; ``skip`` leaves out a tensor, ``tokenizer=False`` the vocabulary; ``types`` overrides
    GEMMA3_QTYPES by short name (a K type writes random blocks: the file, not ``hf``, is then the model)."""
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
    w.add_uint32("gemma3.vocab_size", len(GEMMA3_TOKENS))
    if tokenizer:
        w.add_tokenizer_model("llama")
        w.add_token_list(GEMMA3_TOKENS)
        w.add_token_scores([-float(i) for i in range(len(GEMMA3_TOKENS))])
        w.add_token_types(GEMMA3_TYPES)
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
            short = _GEMMA3_LAYER[rest.removesuffix(".weight")]
            gname = f"blk.{i}.{short}.weight"
        if gname != skip:
            _add_tensor(w, gname, arr, {**GEMMA3_QTYPES, **(types or {})}.get(short, Q.F32))
    return _finish(w, path)


# --- a tokenizer alone --------------------------------------------------------------------------------

def write_bpe_tokenizer_gguf(path: Path, model: str = "gpt2", pre: str = "smollm", arch: str = "llama",
                             merges: tuple[str, ...] = ("h e",), control: str = "<|end|>") -> Path:
    """A GGUF with no tensors and a byte-level BPE vocabulary: the 256 byte pieces, one piece per
    merge (``"h e"`` -> ``"he"``), then ``control`` (a CONTROL token, also EOS). The defaults give
    258 tokens: ``"he"`` is 256, ``<|end|>`` 257."""
    from kvviz.engine.tokenize.tokenizer import _gpt2_byte_decoder

    dec = _gpt2_byte_decoder()
    tokens = sorted(dec, key=dec.__getitem__) + [m.replace(" ", "") for m in merges] + [control]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(list(merges))
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_eos_token_id(len(tokens) - 1)
    return _finish(w, path)


# --- a Llama SentencePiece vocabulary alone ---------------------------------------------------------

# Llama 2's conventions (Mistral's and TinyLlama's too): <unk> 0 (UNKNOWN), <s> 1 and </s> 2
# (CONTROL), the 256 byte pieces (BYTE), then the merged pieces best first and the single
# characters last, each scored by its rank (the bytes and specials score 0). "[INST]" is a Mistral
# control token. One pair is out of order on purpose: "▁a" comes before "ab" in the file but scores
# lower, and there is no "▁ab": SentencePiece ranks by score, so "▁ab" is "▁" + "ab", not "▁a" + "b".
_S = "\u2581"  # ▁
_SPM_MERGED = [_S * 2, _S + "t", "er", "in", _S + "a", "en", "on", _S + "th", "es", _S * 4, _S + "s", "at", "or", "re",
               _S + "the", _S * 3, "ab", _S + "d", "ef", _S + "def", _S + "re", "turn", _S + "return", "12", _S + "x",
               _S + "in", _S + "int", "\u00e9t", _S + "\u00e9t", "\u65e5"]
_SPM_CHARS = [_S, *"etaoinsrhdlcumfpgwybvkxjqz", *"0123456789", *"():,.=+*#-_\"'", *"TIé€"]
LLAMA_SPM_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_MERGED + _SPM_CHARS
                    + ["[INST]"])
LLAMA_SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * (len(_SPM_MERGED) + len(_SPM_CHARS)) + [3]
_SPM_ORDER = {_S + "a": 16.5, "ab": 4.5}  # rank overrides: the out-of-order pair
LLAMA_SPM_SCORES = ([0.0] * 259 + [-float(_SPM_ORDER.get(t, i)) for i, t in enumerate(_SPM_MERGED + _SPM_CHARS)]
                    + [0.0])


def add_spm_vocab(w: Any, add_space_prefix: bool | None = True, add_bos: bool | None = True,
                  byte_pieces: bool = True) -> None:
    """LLAMA_SPM_TOKENS as llama.cpp's converter writes a Llama 2 vocabulary (``tokenizer.ggml.model``
    "llama"); None leaves a flag out of the file; ``byte_pieces=False`` drops the 256 ``<0xNN>``."""
    keep = [i for i, k in enumerate(LLAMA_SPM_TYPES) if byte_pieces or k != 6]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([LLAMA_SPM_TOKENS[i] for i in keep])
    w.add_token_scores([LLAMA_SPM_SCORES[i] for i in keep])
    w.add_token_types([LLAMA_SPM_TYPES[i] for i in keep])
    w.add_bos_token_id(1)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)


def write_spm_tokenizer_gguf(path: Path, arch: str = "llama", chat_template: str | None = None, **kw: Any) -> Path:
    """A GGUF with no tensors and the Llama SentencePiece vocabulary (``add_spm_vocab``'s keywords), EOS 2."""
    w = gguf.GGUFWriter(str(path), arch)
    add_spm_vocab(w, **kw)
    w.add_eos_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return _finish(w, path)
