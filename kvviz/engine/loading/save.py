"""Write models: kvviz's own folder layout, and a Hugging Face GPT-2 folder transformers can load.

Safetensors only, like loading: nothing here ever writes a pickle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvviz.engine.loading.loader import KVVIZ_MODEL_TYPE
from kvviz.engine.models.gpt2 import GPT
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

