"""vLLM's serve flags (VLLMSettings) and the defaults that decide the sizing but are not in the model's
config: max_num_batched_tokens by device, the tokens in flight under async scheduling, the CPU
backend's block size and budget.

Followed from the vLLM 0.33.0 sdist (line numbers of that version):

- max_num_batched_tokens (vllm/engine/arg_utils.py:2973-3004, 3027-3036, get_batch_defaults): for
  `vllm serve`, 16,384 on a device of >= 160 GiB; 8,192 on one of >= 70 GiB that is neither an A100
  nor a GB10 (DGX Spark, which has the memory but not the compute); 2,048 on others. The offline
  ``vllm.LLM`` defaults are larger (16,384 / 16,384 / 8,192). The CPU backend: 2,048 x world size for
  the server, 4,096 x world size for ``vllm.LLM``.
- tokens in flight (vllm/config/vllm.py:588-609): max_concurrent_batches x max_num_batched_tokens;
  with async scheduling (on by default on GPUs, config/vllm.py:1685-1719) that is PP + 1 batches
  (model runner V2, the default) and 2 at PP 1; without it, PP batches. The CPU backend turns async
  scheduling off (vllm/platforms/cpu.py:347-348).
- the CPU backend (vllm/platforms/cpu.py:341-344, 550-563): the KV budget is VLLM_CPU_KVCACHE_SPACE
  GiB (an integer), the block size 128 unless --block-size is given, and the line reads "CPU KV
  cache size" (v1/core/kv_cache_utils.py:1131-1133 names the device type).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvviz.calculator.spec import ModelSpec

DEFAULT_BATCHED_TOKENS = 2048  # `vllm serve`'s max_num_batched_tokens on most GPUs and on CPUs (x world size)
GPU_BLOCK_SIZE = 16  # CacheConfig.block_size's default on GPUs
CPU_BLOCK_SIZE = 128  # platforms/cpu.py:562 (_preferred_block_size_for_backends(..., 128, ...))
DEVICES = ("cuda", "cpu")
ARG_UTILS = "vllm/engine/arg_utils.py:2973-3004"


def default_batched_tokens(gpu_gib: float | None, gpu_name: str = "", device: str = "cuda",
                           world_size: int = 1) -> int:
    """`vllm serve`'s default max_num_batched_tokens (arg_utils.py:2973-3004, 3027-3036)."""
    if device == "cpu":
        return DEFAULT_BATCHED_TOKENS * max(1, world_size)
    if gpu_gib is None:
        return DEFAULT_BATCHED_TOKENS
    name = gpu_name.lower()
    if gpu_gib >= 160:
        return 16384
    if gpu_gib >= 70 and "a100" not in name and "gb10" not in name:
        return 8192
    return DEFAULT_BATCHED_TOKENS


def default_block_size(device: str) -> int:
    """The block size vLLM picks when --block-size is not given."""
    return CPU_BLOCK_SIZE if device == "cpu" else GPU_BLOCK_SIZE


def concurrent_batches(pp: int, async_scheduling: bool, device: str = "cuda") -> int:
    """VllmConfig.max_concurrent_batches (config/vllm.py:588-598): PP + 1 under async scheduling
    (model runner V2; 2 at PP 1 with either runner), PP without it; the CPU backend has it off."""
    if async_scheduling and device != "cpu":
        return pp + 1
    return pp


def device_label(device: str) -> str:
    """_kv_cache_device_name (kv_cache_utils.py:1131-1133): "GPU" for CUDA, else the device type upper-cased."""
    return "GPU" if device == "cuda" else device.upper()


@dataclass(frozen=True)
class VLLMSettings:
    """The serve flags that decide the sizing."""

    kv_memory_bytes: int  # "Available KV cache memory", per GPU (CPU: VLLM_CPU_KVCACHE_SPACE)
    max_model_len: int
    block_size: int = 16
    tp: int = 1
    pp: int = 1
    kv_dtype: str = "bf16"
    max_num_batched_tokens: int = DEFAULT_BATCHED_TOKENS
    hybrid: bool = True  # False: --disable-hybrid-kv-cache-manager (every layer kept as full attention)
    device: str = "cuda"  # "cpu": the CPU backend
    async_scheduling: bool = True  # --no-async-scheduling: False (the CPU backend forces it off)
    draft: ModelSpec | None = None  # --draft-config: a speculative draft whose layers hold KV too
    older: bool = False  # vLLM before 0.33's rules (logs that say "models's"): one batch in flight, no null block
    pp_layers: tuple[int, ...] = ()  # VLLM_PP_LAYER_PARTITION: layers per stage ((): even shares)
    stage_memory: tuple[int, ...] = ()  # each stage's available KV bytes ((): kv_memory_bytes on every stage)
    kv_cache_layout: str | None = None  # VLLM_KV_CACHE_LAYOUT (None: the backend's first, LBNHC / CPU LBHNC)

    @property
    def in_flight(self) -> int:
        """VllmConfig.max_in_flight_tokens (config/vllm.py:601-609); older vLLM held max_num_batched_tokens."""
        if self.older:
            return self.max_num_batched_tokens
        return concurrent_batches(self.pp, self.async_scheduling, self.device) * self.max_num_batched_tokens
