"""vLLM's KV-cache formats (--kv-cache-dtype): the bytes one token takes in one KV head's slot of a
page, scales included.

Followed from the vLLM 0.33.0 sdist (line numbers of that version):

- the page (v1/kv_cache_interface.py:585-602): KV heads x tokens x content, content = (head_size +
  head_size_v) x the dtype's bytes; fp16/bf16 2, fp32 4, fp8 (fp8_e4m3, fp8_e5m2) 1.
- the per-token-head formats (config/cache.py:44-68, kv_cache_interface.py:40-70):
  int8_per_token_head and fp8_per_token_head store one byte a value and an inline fp32 scale for K
  and one for V: (head_size + head_size_v) x 1 + 2 x 4 B; int4_per_token_head packs two values a
  byte: (head_size / 2 + head_size_v / 2) + 8 B (TritonAttentionBackend.customize_spec,
  v1/attention/backends/triton_attn.py:307-319). Under MLA the latent has one side: latent x 1 + 8 B
  (int4: latent / 2 + 8; MLACommonBackend.customize_spec, model_executor/layers/attention/
  mla_attention.py:1598-1612).
- DeepSeek's sparse-MLA layouts pack NoPE, RoPE and scales into one opaque blob a token:
  fp8_ds_mla 656 B, nvfp4_ds_mla 352 B (mla_attention.py:1383-1388).
The other packed formats (turboquant_*, octave_*, nvfp4, ultraquant_4bit) are refused with a sentence.
"""
from __future__ import annotations

FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}  # torch.uint8 holds fp8
PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
DS_MLA_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
KV_DTYPES: tuple[str, ...] = (*FLOAT_BYTES, *PER_TOKEN_HEAD, *DS_MLA_BYTES)
SCALE_BYTES = 4  # torch.float32, one scale for K and one for V (one pair under MLA)


def kv_dtype_problem(kv_dtype: str, mla: bool) -> str | None:
    """Why vLLM (as kvviz models it) cannot size this format for this model, or None."""
    if kv_dtype not in KV_DTYPES:
        return (f"vLLM's --kv-cache-dtype {kv_dtype!r} is not one kvviz sizes ({', '.join(KV_DTYPES)}); its packed "
                "layouts (turboquant, octave, nvfp4, ultraquant) are not modelled yet")
    if kv_dtype in DS_MLA_BYTES and not mla:
        return f"--kv-cache-dtype {kv_dtype} is DeepSeek's sparse-MLA layout: this model has no MLA"
    return None


def slot_bytes(kv_dtype: str, head_k: int, head_v: int) -> tuple[int, str]:
    """(bytes one token takes in one KV head's slot, how), head_v = 0 under MLA (the latent is K only)."""
    if kv_dtype in DS_MLA_BYTES:
        return DS_MLA_BYTES[kv_dtype], f"{DS_MLA_BYTES[kv_dtype]} B ({kv_dtype}'s packed token)"
    if kv_dtype in PER_TOKEN_HEAD:
        if kv_dtype == "int4_per_token_head":
            k, v = head_k // 2, head_v // 2
            values = f"({head_k} / 2{f' + {head_v} / 2' if head_v else ''}) B"
        else:
            k, v = head_k, head_v
            values = f"({head_k}{f' + {head_v}' if head_v else ''}) x 1 B"
        return k + v + 2 * SCALE_BYTES, f"{values} + 2 x {SCALE_BYTES} B scales"
    n = FLOAT_BYTES[kv_dtype]
    if head_v:
        return (head_k + head_v) * n, f"({head_k} + {head_v}) (K, V) x {n} B"
    return head_k * n, f"{head_k} latent x {n} B"
