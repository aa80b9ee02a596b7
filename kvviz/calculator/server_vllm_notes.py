"""The words around vLLM's figures: its too-long error, as each version wrote it, and the notes on
what a sizing assumes (tokens in flight, padding layers, chunked attention, MLA blocks, PP batches).
"""
from __future__ import annotations

from kvviz.calculator.server_vllm_defaults import VLLMSettings
from kvviz.calculator.spec import ModelSpec
from kvviz.units import GIB

DOCS_URL = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"


def format_gib(n: int, older: bool = False) -> str:
    """vLLM's GiB in its messages: ``f"{round(b / GiB_bytes, 2)}"`` (vllm/utils/mem_utils.py:30-31), so
    2 GiB reads "2.0" and 1.234 GiB "1.23" (vLLM 0.32's own too-long error on this machine); the older
    vLLM of the "models's" error printed two decimals ("62.00 GiB" in the issue logs kvviz keeps)."""
    return f"{n / GIB:.2f}" if older else f"{round(n / GIB, 2)}"


def too_long_text(L: int, needed: int, check: int, estimate: int | None, older: bool = False) -> str:
    """vLLM's error (kv_cache_planning.py:66-86); older vLLM wrote "models's" and had no docs link."""
    est = (f"Based on the available memory, the estimated maximum model length is {estimate}. " if estimate else "")
    if older:
        return (f"ValueError: To serve at least one request with the models's max seq len ({L}), "
                f"({format_gib(needed, True)} GiB KV cache is needed, which is larger than the available KV cache "
                f"memory ({format_gib(check, True)} GiB). {est}Try increasing `gpu_memory_utilization` or "
                "decreasing `max_model_len` when initializing the engine.")
    return (f"ValueError: To serve at least one request with the model's max seq len ({L}), "
            f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache "
            f"memory ({format_gib(check)} GiB). {est}Try increasing `gpu_memory_utilization` (which also controls "
            "CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
            f"See {DOCS_URL} for more details.")


def sizing_notes(spec: ModelSpec, s: VLLMSettings, keys: list[tuple[str, int | None]], n_groups: int,
                 group_size: int, n_layers: int) -> list[str]:
    """What the figures assume that the user may need to set: the tokens in flight, padding layers,
    chunked attention and the hybrid manager, MLA's block size, a length beyond the positions, PP batches."""
    notes = []
    if any(k[0] in ("sliding", "chunked") for k in keys):
        batches = s.in_flight // s.max_num_batched_tokens
        notes.append(f"sliding and chunked groups hold at most window (or chunk) + {s.in_flight:,} tokens in flight "
                     f"a request ({batches} x max_num_batched_tokens {s.max_num_batched_tokens:,}"
                     + (", async scheduling" if batches > s.pp else "") + "): set --max-num-batched-tokens to the "
                     "server's" + (", --no-async-scheduling if it has it off" if batches > s.pp else ""))
    if n_groups > 1 and n_layers < n_groups * group_size:
        pad = n_groups * group_size - n_layers
        notes.append(f"{pad} padding layer(s): vLLM pads every group to {group_size} layers")
    if s.hybrid and any(k[0] == "chunked" for k in keys):
        notes.append("vLLM turns its hybrid KV-cache manager off for chunked local attention unless "
                     "VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (off by default in most releases): "
                     "without the variable, pass --no-hybrid-kv-cache-manager")
    if spec.mla is not None and s.block_size != 64:
        notes.append("vLLM's MLA backends (FlashMLA, CUTLASS MLA) use 64-token (or larger) blocks: pass the "
                     "server's --block-size")
    if spec.max_positions is not None and s.max_model_len > spec.max_positions:
        notes.append(f"max_model_len {s.max_model_len:,} is beyond max_position_embeddings {spec.max_positions:,}: "
                     "vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    if s.pp > 1 and s.async_scheduling and s.device != "cpu":
        notes.append(f"pp {s.pp} with async scheduling: {s.pp + 1} batches in flight with model runner V2 (the "
                     f"default); the V1 runner turns async scheduling off under PP ({s.pp} batches)")
    return notes
