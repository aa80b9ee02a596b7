"""The bench's Gemma 3 pieces: transformers' ``Gemma3ForCausalLM`` holding kvviz's own tensors, and
the decode step's weight matmuls for the floors.

The floor's matmuls are grouped as kvviz.fast's Gemma step calls them (q|k|v, o, gate|up, down,
then the tied LM head). ``floor`` runs them on the GGUF's block codes, as the step does
(``fast/blockdot.py``); ``floor_fp32`` on the readable model's fp32 weights through the fp32 row
kernel: what the step would stream without the codes (1,022.5 MiB a token instead of 234.95).
``coded_matmuls`` groups a Llama-family GGUF's step the same way (``fast/llama_codes.py``), for
SmolLM2's floors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.models.gemma3 import SLIDING, Gemma3
from kvviz.fast.blockdot import Group, block_dot, matching_codes
from kvviz.engine.loading.gguf_codes import BlockCodes
from kvviz.fast.gemma3_flat import groups
from kvviz.fast.llama_codes import FastLlamaCodes
from kvviz.fast.llama_codes import groups as llama_groups
from kvviz.fast.llama_flat import Linear
from kvviz.fast.rowops import RowDot


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


@dataclass(frozen=True)
class CodedLinear(Linear):
    """A fused call on block codes: ``ws`` are the fp32 parameters (their shapes), ``codes`` what is read."""

    codes: tuple[BlockCodes, ...] = ()

    def row_op(self, threads: int) -> RowDot | None:  # type: ignore[override]
        return block_dot(self.codes, threads)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.codes)


def gemma3_matmuls(model: LoadedModel, coded: bool = True) -> list[Linear]:
    """Every weight matmul of one decode step, one entry per call kvviz.fast's step makes: each
    layer's q|k|v, o, gate|up and down, then the LM head (the 262,144 x 640 embedding, tied). With
    ``coded``, a group whose every weight has matching block codes reads those."""
    net = model.model
    assert isinstance(net, Gemma3)
    return _grouped(groups(net), getattr(model.fast, "codes", {}) if coded else {})


def on_codes(model: LoadedModel) -> bool:
    """Whether the model's accelerator multiplies by block codes (Gemma 3, or a Llama-family GGUF)."""
    return is_gemma3(model) or isinstance(model.fast, FastLlamaCodes)


def coded_matmuls(model: LoadedModel, coded: bool = True) -> list[Linear]:
    """``gemma3_matmuls`` for either family on codes: the Llama family's calls are grouped as
    ``fast/llama_codes.py`` makes them (q|k|v, o, gate|up, down, then the LM head)."""
    if is_gemma3(model):
        return gemma3_matmuls(model, coded)
    assert isinstance(model.fast, FastLlamaCodes)
    return _grouped(llama_groups(model.fast.model), model.fast.codes if coded else {})


def _grouped(every: list[Group], codes: dict[str, BlockCodes]) -> list[Linear]:
    out: list[Linear] = []
    for group in every:
        ws = tuple(w.detach() for w in group[1])
        cs = matching_codes(group, codes)
        out.append(Linear(ws, tuple(None for _ in ws)) if cs is None
                   else CodedLinear(ws, tuple(None for _ in ws), tuple(cs)))
    return out
