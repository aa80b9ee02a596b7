"""config.json files of every KV layout kvviz sizes, for vLLM started with dummy weights
(``--load-format dummy``): the sizing tests need the engine's arithmetic, not real weights."""
from __future__ import annotations

from typing import Any

_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "vocab_size": 49152,
}
LAYOUTS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct's own shape (tied head, GQA 9/3, head 64, 30 layers)
    "smollm2": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
                "tie_word_embeddings": True},
    # an untied Llama with 8 KV heads of 128 (Llama 3's head), small
    "llama-untied": {**_LLAMA, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8,
                     "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128,
                     "max_position_embeddings": 131072, "tie_word_embeddings": False},
    # Qwen3: q/k norms, head_dim 128 apart from hidden / heads
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 512,
              "intermediate_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936, "hidden_act": "silu"},
    # Mistral: one window on every layer
    "mistral-window": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 512,
                       "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 1024,
                       "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                       "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
                       "hidden_act": "silu"},
    # Gemma 3 270M's text config: 15 sliding layers (window 512) and 3 global ones, one KV head of 256
    "gemma3-270m": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
                    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
                    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
                    "max_position_embeddings": 32768, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
                    "torch_dtype": "bfloat16", "vocab_size": 262144, "tie_word_embeddings": True,
                    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
}
