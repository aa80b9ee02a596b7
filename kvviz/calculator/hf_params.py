"""Parameter counts from config.json, per family layout, so weights can be sized without the weights.

Each counter mirrors its family's transformers modules (every Linear, norm and bias); the tests
compare the results with the totals published for real checkpoints.
"""
from __future__ import annotations

from typing import Any, Mapping

from kvviz.calculator.hf_fields import KVVIZ_MODEL_TYPE, LLAMA_LIKE, TIE_DEFAULT, Reader
from kvviz.calculator.spec import ModelSpec


def count_params(raw: Mapping[str, Any], mtype: str, s: ModelSpec, notes: list[str]) -> tuple[int | None, int | None, str]:
    """(total, active, how) for the architectures whose layout is known; (None, None, why) otherwise."""
    rd = Reader(raw)
    v = s.vocab_size
    if mtype == "gpt2" or mtype == KVVIZ_MODEL_TYPE:
        fn = _gpt2_params
    elif mtype in LLAMA_LIKE:
        fn = _llama_params
    elif mtype == "falcon":
        fn = _falcon_params
    elif mtype == "opt":
        fn = _opt_params
    elif mtype in ("deepseek_v2", "deepseek_v3"):
        fn = _deepseek_params
    elif mtype == "gpt_oss":
        fn = _gpt_oss_params
    elif mtype == "llama4_text":
        fn = _llama4_params
    elif mtype == "qwen3_next":
        fn = _qwen3_next_params
    else:
        return None, None, "unknown architecture: enter a parameter count"
    if v is None:
        return None, None, "vocab_size missing: enter a parameter count"
    out = fn(rd, mtype, s, v)
    if out is None or rd.problems:
        missing = "; ".join(rd.problems) or "fields missing"
        notes.append(f"parameter count not computed ({missing})")
        return None, None, f"not computed ({missing}): enter a parameter count"
    total, active = out
    how = f"computed from the config ({mtype} layout)"
    if (mtype == "deepseek_v3" and raw.get("num_nextn_predict_layers")) or mtype == "qwen3_next":
        # Both checkpoints ship a multi-token-prediction layer (DeepSeek-V3's num_nextn_predict_layers,
        # Qwen3-Next's mtp.* weights) that transformers does not load; servers load it for speculation.
        notes.append("the multi-token-prediction (MTP) layer shipped with the checkpoint is not counted: "
                     "transformers does not load it")
        how += "; MTP layer not counted"
    return total, active, how


def _tied(rd: Reader, mtype: str) -> bool:
    return rd.bool("tie_word_embeddings", TIE_DEFAULT.get(mtype, False))


def _gpt2_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L = s.hidden, s.n_layers
    if mtype == KVVIZ_MODEL_TYPE:
        pos = rd.int("block_size")
        bias = rd.bool("bias", True)
        inner = 4 * c
    else:
        pos = rd.int(("n_positions", "n_ctx"))
        bias = True
        inner = rd.int("n_inner", required=False) or 4 * c
    if pos is None:
        return None
    b = 1 if bias else 0
    qkv = c + 2 * s.n_kv_heads * s.head_dim
    layer = (2 * c * (1 + b)  # ln_1, ln_2
             + c * qkv + b * qkv  # c_attn
             + c * c + b * c  # attn c_proj
             + c * inner + b * inner + inner * c + b * c)  # mlp
    total = v * c + pos * c + L * layer + c * (1 + b)  # wte, wpe, blocks, ln_f; lm_head tied to wte
    return total, total


def _llama_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    inter = rd.int("intermediate_size")
    if inter is None:
        return None
    attn = c * h * hd + 2 * c * kv * hd + h * hd * c
    if mtype == "qwen2" or rd.bool("attention_bias", False):
        attn += h * hd + 2 * kv * hd  # Qwen2 always has q/k/v biases; llama's attention_bias adds them
        if mtype != "qwen2" and rd.bool("attention_bias", False):
            attn += c  # o_proj bias too (llama's attention_bias covers all four)
    if mtype in ("qwen3", "gemma3_text"):
        attn += 2 * hd  # q_norm and k_norm (RMSNorm over head_dim)
    norms = (4 if mtype in ("gemma2", "gemma3_text") else 2) * c  # Gemma 2 and 3 add pre/post feed-forward norms
    mlp = 3 * c * inter + (2 * inter + c if rd.bool("mlp_bias", False) else 0)
    if mtype == "mixtral":
        experts = rd.int("num_local_experts")
        k = rd.int("num_experts_per_tok")
        if experts is None or k is None:
            return None
        layer_total = attn + norms + experts * mlp + c * experts  # experts + router
        layer_active = attn + norms + k * mlp + c * experts
    else:
        layer_total = layer_active = attn + norms + mlp
    emb = v * c * (1 if _tied(rd, mtype) else 2)
    return emb + L * layer_total + c, emb + L * layer_active + c


def _falcon_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    bias = rd.bool("bias", False)
    ffn = rd.int("ffn_hidden_size", required=False) or 4 * c
    new_arch = rd.bool("new_decoder_architecture", False)
    qkv = (h + 2 * kv) * hd
    layer = c * qkv + h * hd * c + 2 * c * ffn
    if bias:
        layer += qkv + c + ffn + c
    if new_arch:
        n_ln = rd.int("num_ln_in_parallel_attn", required=False) or 2
    else:
        n_ln = 1 if rd.bool("parallel_attn", True) else 2
    layer += n_ln * 2 * c  # LayerNorms with bias
    emb = v * c * (1 if _tied(rd, mtype) else 2)
    total = emb + L * layer + 2 * c
    return total, total


def _opt_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L = s.hidden, s.n_layers
    ffn = rd.int("ffn_dim")
    pos = rd.int("max_position_embeddings")
    if ffn is None or pos is None:
        return None
    proj = rd.int("word_embed_proj_dim", required=False) or c
    b = 1 if rd.bool("enable_bias", True) else 0
    layer = 4 * (c * c + b * c) + (c * ffn + b * ffn) + (ffn * c + b * c) + 2 * 2 * c
    total = v * proj + (pos + 2) * c + L * layer  # OPT's learned positions carry an offset of 2
    if proj != c:
        total += 2 * c * proj  # project_in / project_out
    if rd.bool("do_layer_norm_before", True) and not rd.bool("_remove_final_layer_norm", False):
        total += 2 * c
    if not _tied(rd, mtype):
        total += v * proj
    return total, total


def _deepseek_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    assert s.mla is not None
    c, L, h, m = s.hidden, s.n_layers, s.n_heads, s.mla
    q_rank = rd.int("q_lora_rank", required=False)
    inter = rd.int("intermediate_size")
    moe_inter = rd.int("moe_intermediate_size", required=False)
    n_routed = rd.int("n_routed_experts", required=False)
    n_shared = rd.int("n_shared_experts", required=False, minimum=0) or 0
    k = rd.int("num_experts_per_tok", required=False)
    first_dense = rd.int("first_k_dense_replace", required=False, minimum=0) or 0
    freq = rd.int("moe_layer_freq", required=False) or 1
    if inter is None:
        return None
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = c * q_rank + q_rank + q_rank * h * qk if q_rank else c * h * qk  # low-rank q with its norm
    attn = q + c * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) \
        + h * m.v_head_dim * c
    dense_mlp = 3 * c * inter
    total = active = v * c * (1 if _tied(rd, mtype) else 2) + c
    for i in range(L):
        total += attn + 2 * c
        active += attn + 2 * c
        if n_routed and moe_inter and i >= first_dense and i % freq == 0:
            expert = 3 * c * moe_inter
            router = c * n_routed + (n_routed if mtype == "deepseek_v3" else 0)  # V3's score-correction bias
            total += (n_routed + n_shared) * expert + router
            active += ((k or 0) + n_shared) * expert + router
        else:
            total += dense_mlp
            active += dense_mlp
    return total, active


def _ints(*values: int | None) -> tuple[int, ...] | None:
    """All the values when every one was read; None when any is missing (the reader has said why)."""
    return None if any(v is None for v in values) else tuple(v for v in values if v is not None)


def _gpt_oss_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    """gpt-oss: biased q/k/v/o, one attention sink per head, experts with fused biased gate_up, a biased router."""
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    got = _ints(rd.int("intermediate_size"), rd.int("num_local_experts"),
                rd.int(("num_experts_per_tok", "experts_per_token")))
    if got is None:
        return None
    inter, experts, k = got
    attn = (c * h * hd + h * hd) + 2 * (c * kv * hd + kv * hd) + (h * hd * c + c) + h  # + sinks
    expert = (c * 2 * inter + 2 * inter) + (inter * c + c)
    base = attn + 2 * c + c * experts + experts  # norms, router
    emb = v * c * (1 if _tied(rd, mtype) else 2)
    return emb + L * (base + experts * expert) + c, emb + L * (base + k * expert) + c


def _llama4_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    """Llama 4: MoE layers (routed experts + one shared expert + a router) every interleave step, dense
    MLPs of intermediate_size_mlp between; L2 qk-norm has no weights."""
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    inter = rd.int("intermediate_size")
    got = _ints(inter, rd.int("intermediate_size_mlp", required=False, default=inter), rd.int("num_local_experts"),
                rd.int("num_experts_per_tok"), rd.int("interleave_moe_layer_step", required=False, default=1))
    if got is None:
        return None
    inter, inter_mlp, experts, k, step = got
    moe_layers = rd.raw.get("moe_layers")
    if not isinstance(moe_layers, list) or not all(isinstance(i, int) for i in moe_layers):
        moe_layers = list(range(step - 1, L, step))  # Llama4TextConfig's default
    n_moe = len({i for i in moe_layers if 0 <= i < L})
    attn = c * h * hd + 2 * c * kv * hd + h * hd * c
    if rd.bool("attention_bias", False):
        attn += h * hd + 2 * kv * hd + c
    mlp = 3 * c * inter
    moe_total = experts * mlp + mlp + c * experts  # routed + shared + router
    moe_active = k * mlp + mlp + c * experts
    base = L * (attn + 2 * c) + (L - n_moe) * 3 * c * inter_mlp
    emb = v * c * (1 if _tied(rd, mtype) else 2)
    return emb + base + n_moe * moe_total + c, emb + base + n_moe * moe_active + c


def _qwen3_next_params(rd: Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    """Qwen3-Next: gated full attention (q_proj doubled for the gate, q/k norms), Gated DeltaNet linear
    attention, and sparse MoE with a gated shared expert."""
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    got = _ints(rd.int("intermediate_size"), rd.int("moe_intermediate_size"),
                rd.int("shared_expert_intermediate_size", required=False, default=0, minimum=0),
                rd.int("num_experts", required=False, default=0, minimum=0),
                rd.int("num_experts_per_tok", required=False, default=0, minimum=0),
                rd.int("decoder_sparse_step", required=False, default=1))
    st = s.state
    if got is None or st is None:
        return None
    inter, moe_inter, shared, experts, k, sparse_step = got
    dense_only = rd.raw.get("mlp_only_layers") or []
    full = c * 2 * h * hd + 2 * c * kv * hd + h * hd * c + 2 * hd
    value_dim = st.heads * st.head_v
    qk_dim = st.conv_channels - value_dim  # the conv runs over q and k (qk_dim channels together) and v
    # in_proj_qkvz, in_proj_ba, conv1d (kernel = width + 1, no bias), dt_bias + A_log, the gated norm, out_proj
    linear = (c * (qk_dim + 2 * value_dim) + c * 2 * st.heads + st.conv_channels * (st.conv_width + 1)
              + 2 * st.heads + st.head_v + value_dim * c)
    routed = 3 * c * moe_inter
    gate = c * experts + 3 * c * shared + c  # router, shared expert and its one-output gate
    total = active = v * c * (1 if _tied(rd, mtype) else 2) + c
    for i in range(L):
        attn = full if s.layer(i).has_kv else linear
        total += attn + 2 * c
        active += attn + 2 * c
        if experts and i not in dense_only and (i + 1) % sparse_step == 0:
            total += experts * routed + gate
            active += k * routed + gate
        else:
            total += 3 * c * inter
            active += 3 * c * inter
    return total, active
