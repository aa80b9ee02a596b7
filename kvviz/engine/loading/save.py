"""Write models: kvviz's own folder layout, and a Hugging Face folder transformers and vLLM load
(GPT-2, the Llama family, Gemma 3: ``export_hf``).

Safetensors only, like loading: nothing here ever writes a pickle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvviz.engine.loading.loader import KVVIZ_MODEL_TYPE
from kvviz.engine.models.gemma3 import Gemma3Config
from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.tokenize.spm import SPMTokenizer
from kvviz.engine.tokenize.tokenizer import ByteTokenizer
from kvviz.errors import KVVizError


def save_model(gpt: GPT, folder: Path, extra_config: dict[str, Any] | None = None) -> None:
    """kvviz's own layout: config.json (GPTConfig + model_type) and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": KVVIZ_MODEL_TYPE, **gpt.config.to_dict(), "tokenizer": "bytes", **(extra_config or {})}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    sd = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in gpt.state_dict().items()
          if k != "lm_head.weight"}  # tied: stored once, as wte
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt", "model_type": KVVIZ_MODEL_TYPE})


def export_hf_gpt2(gpt: GPT, folder: Path) -> None:
    """Write a Hugging Face GPT-2 folder (Conv1D layout) that transformers can load."""
    from safetensors.torch import save_file

    c = gpt.config
    if c.kv_heads != c.n_head:
        raise KVVizError("GPT-2 has no grouped-query attention: only MHA models export to HF GPT-2")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_cfg = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.vocab_size,
        "n_positions": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer, "n_head": c.n_head,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": c.layer_norm_epsilon,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
        "bos_token_id": c.eos_token_id, "eos_token_id": c.eos_token_id,
    }
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    sd = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in gpt.state_dict().items()
          if k != "lm_head.weight"}  # Conv1D weights are already (in, out), HF's layout
    if not c.bias:
        # GPT-2 always has biases (and so does a gpt2 config.json read back): zeros are exact.
        C = c.n_embd
        widths = {"ln_1.bias": C, "attn.c_attn.bias": 3 * C, "attn.c_proj.bias": C, "ln_2.bias": C,
                  "mlp.c_fc.bias": 4 * C, "mlp.c_proj.bias": C}
        for i in range(c.n_layer):
            sd.update({f"transformer.h.{i}.{k}": torch.zeros(n) for k, n in widths.items()})
        sd["transformer.ln_f.bias"] = torch.zeros(C)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})



# ------------------------------------------------------------------ any family -> a transformers folder
# The architectures transformers and vLLM name each family by; kvviz's Llama flags (qkv_bias, qk_norm,
# sliding_window) are what those classes imply, so the class alone carries them.
_HF_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def hf_config(model: Any) -> dict[str, Any]:
    """The transformers ``config.json`` of a Llama-family or Gemma 3 model (``model.config``), in the
    layout transformers 4.5x and 5.x both read (``rope_theta`` beside ``rope_parameters``)."""
    c = model.config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    common = {
        "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
        "eos_token_id": c.eos_token_id, "torch_dtype": dtype, "dtype": dtype,
    }
    if isinstance(c, Gemma3Config):
        if c.final_logit_softcapping is not None:
            common["final_logit_softcapping"] = c.final_logit_softcapping
        return {
            "model_type": "gemma3_text", "architectures": [_HF_ARCH["gemma3"]], **common,
            "max_position_embeddings": c.context_length, "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": c.rope_theta, "rope_local_base_freq": c.rope_local_theta,
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
            "sliding_window": c.sliding_window, "sliding_window_pattern": c.sliding_pattern,
            "layer_types": ["full_attention" if t == "full" else "sliding_attention" for t in c.layer_types],
            "query_pre_attn_scalar": _int_if_whole(c.query_pre_attn_scalar), "attention_bias": False,
            "final_logit_softcapping": c.final_logit_softcapping, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
        }
    family = c.family
    out = {
        "model_type": family, "architectures": [_HF_ARCH[family]], **common,
        "max_position_embeddings": c.block_size, "hidden_act": "silu",
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
    }
    if family in ("llama", "mistral"):
        out.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    if family == "mistral":
        out["sliding_window"] = c.sliding_window
    elif family in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None)
        if family == "qwen3":
            out["attention_bias"] = c.attention_bias
    return out


def _int_if_whole(x: float) -> float | int:
    """transformers' Gemma 3 config types query_pre_attn_scalar as an int (256), and refuses 256.0."""
    return int(x) if float(x).is_integer() else x


def _tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """tokenizer.json (+ tokenizer_config.json with the chat template and special tokens): a GGUF's
    byte-level BPE or a tokenizer.json kvviz loaded (already `tokenizers` pipelines), a SentencePiece
    vocabulary (Gemma, Llama 2: ``SPMTokenizer.backend``, the same ids) or the byte tokenizer."""
    backend = getattr(tokenizer, "_tok", None)
    if isinstance(tokenizer, ByteTokenizer):
        backend = _byte_backend(tokenizer.vocab_size)
    elif isinstance(tokenizer, SPMTokenizer):
        backend = tokenizer.backend()
    if backend is None or not hasattr(backend, "to_str"):
        raise KVVizError(f"this model's tokenizer ({type(tokenizer).__name__}) has no tokenizer.json form")
    if getattr(tokenizer, "add_bos", False) and getattr(tokenizer, "bos_token_id", None) is not None:
        from tokenizers import processors

        backend = type(backend).from_str(backend.to_str())  # a copy: the loaded tokenizer stays as it is
        bos = tokenizer.special_tokens["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    special = dict(getattr(tokenizer, "special_tokens", {}))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                           "add_bos_token": bool(getattr(tokenizer, "add_bos", False)),
                           "model_max_length": None, "clean_up_tokenization_spaces": False}
    template = getattr(tokenizer, "chat_template", None)
    if template:
        cfg["chat_template"] = template
    return {"tokenizer.json": backend.to_str(pretty=False),
            "tokenizer_config.json": json.dumps(cfg, indent=2, ensure_ascii=False) + "\n"}


def _byte_backend(vocab_size: int) -> Any:
    """kvviz's byte tokenizer (id = byte value) as a `tokenizers` pipeline: byte-level BPE over
    GPT-2's alphabet with no merges, so each byte is its own token and decode joins the bytes."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from kvviz.engine.tokenize.tokenizer import _gpt2_byte_decoder

    if vocab_size < 256:
        raise KVVizError(f"a byte tokenizer with {vocab_size} ids cannot spell every byte")
    vocab = {ch: b for ch, b in _gpt2_byte_decoder().items()}
    backend = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def export_hf(loaded: Any, folder: Path) -> list[str]:
    """``loaded`` (a LoadedModel of any family kvviz loads) as a folder transformers and vLLM load:
    config.json, model.safetensors (transformers' parameter names, the weights' own dtype; a tied
    head stored once), tokenizer.json, tokenizer_config.json (the chat template), generation_config.json.
    Returns the files written. The tokenizer is checked first, so a refusal writes nothing."""
    from safetensors.torch import save_file

    folder = Path(folder)
    files = _tokenizer_files(loaded.tokenizer) if loaded.has_tokenizer else {}
    net = loaded.model
    if isinstance(net, GPT):
        export_hf_gpt2(net, folder)
    else:
        folder.mkdir(parents=True, exist_ok=True)
        cfg = hf_config(net)
        sd = {k: v.detach().to("cpu").contiguous() for k, v in net.state_dict().items()
              if not (cfg["tie_word_embeddings"] and k == "lm_head.weight")}
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    eos = getattr(loaded.config, "eos_token_id", None)
    gen = {"eos_token_id": eos} if eos is not None else {}
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    if bos is not None:
        gen["bos_token_id"] = bos
    files["generation_config.json"] = json.dumps(gen, indent=2) + "\n"
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return ["config.json", "model.safetensors", *files]
