"""The bench's Gemma 3 pieces: transformers' ``Gemma3ForCausalLM`` holding kvviz's own tensors, and
the decode step's weight matmuls for the floor.

kvviz.fast has no Gemma 3 step (``fast.build`` returns None for it), so ``kvviz_static`` runs the
readable model and the floor's matmuls are read off the readable model's ``nn.Linear`` weights,
grouped as the Llama step fuses them (q|k|v, o, gate|up, down, then the tied LM head) and run
through the same C row kernel where it builds: what a Gemma step in kvviz.fast would stream.
"""
from __future__ import annotations

from typing import Any

import torch

from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.models.gemma3 import SLIDING, Gemma3
from kvviz.fast.llama_flat import Linear


def is_gemma3(model: LoadedModel) -> bool:
    return isinstance(model.model, Gemma3)


def hf_gemma3(model: LoadedModel) -> Any:
    """transformers' Gemma3ForCausalLM with kvviz's tensors assigned (not copied): the same
    weights, so greedy tokens must agree. Built with random init first (about a second for 270M;
    a meta-device build would leave its RoPE and embed-scale buffers empty)."""
    import transformers

    c = model.config
    kinds = {SLIDING: "sliding_attention"}
    q = c.query_pre_attn_scalar  # transformers' config takes an int (256 for every Gemma 3)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=c.block_size,
        rms_norm_eps=c.rms_norm_eps, query_pre_attn_scalar=int(q) if float(q).is_integer() else q,
        sliding_window=c.sliding_window, layer_types=[kinds.get(k, "full_attention") for k in c.layer_types],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": float(c.rope_theta)},
                         "sliding_attention": {"rope_type": "default", "rope_theta": float(c.rope_local_theta)}},
        final_logit_softcapping=c.final_logit_softcapping, attn_logit_softcapping=None,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = transformers.Gemma3ForCausalLM(cfg).to(dtype=model.dtype)
    sd = dict(model.model.state_dict())
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True, assign=True)
    hf.tie_weights()
    return hf.to(model.device).eval()


def gemma3_matmuls(model: LoadedModel) -> list[Linear]:
    """Every weight matmul of one decode step, one entry per call a fused step would make: each
    layer's q|k|v, o, gate|up and down, then the LM head (the 262,144 x 640 embedding, tied)."""
    net = model.model
    assert isinstance(net, Gemma3)

    def lin(*mods: torch.nn.Linear) -> Linear:
        return Linear(tuple(m.weight.detach() for m in mods), tuple(None for _ in mods))

    out: list[Linear] = []
    for layer in net.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [lin(a.q_proj, a.k_proj, a.v_proj), lin(a.o_proj), lin(m.gate_proj, m.up_proj), lin(m.down_proj)]
    return out + [Linear((net.model.embed_tokens.weight.detach(),), (None,))]
