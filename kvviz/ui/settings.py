"""The sidebar's answer: one frozen ``Settings`` value per script run (no streamlit import).

Pages read it from ``state.session.settings()`` (app.py stores it) and turn it into the API's
objects: ``sampling()`` (a ``SamplingParams``), ``cache()`` (a ``CacheSpec``) and ``generate_kwargs()``
(``iter_generate``'s keywords, the prompt first); nothing else parses widget values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.valid_request import CacheSpec

CACHE_MODES: dict[str, str] = {
    "static": "KV cache: static (preallocated)",
    "concat": "KV cache: concat (grows by torch.cat)",
    "none": "No cache (recompute everything)",
}
DTYPE_CHOICES = ("fp32", "bf16", "fp16")
ENGINES: dict[str, str] = {
    "fast": "fast (kvviz.fast: the same maths, flat, with C row kernels)",
    "readable": "readable PyTorch (the model's own forward)",
}


@dataclass(frozen=True)
class Settings:
    model: str = "random:tiny"  # a model choice: "default", "random:NAME" or "folder:NAME" (see state/model_menu.py)
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "fp32"  # weights and KV cache dtype: one of DTYPE_CHOICES
    prompt: str = ""  # exactly as typed; validated by the engine, never trimmed here
    max_new_tokens: int = 128  # tokens to generate (bounded by the context in the sidebar; sidebar.DEFAULT_NEW_TOKENS)
    greedy: bool = True  # argmax; the sampling fields below are ignored when True
    temperature: float = 0.8  # divides the logits before sampling
    top_k: int | None = None  # keep the k most likely tokens (None = off)
    top_p: float | None = None  # keep the smallest set with this much probability (None = off)
    seed: int = 0  # seeds the run's own random generator: same seed, same text
    cache_mode: str = "static"  # one of CACHE_MODES
    speed_tps: float | None = None  # presentation speed: slow live generation to N tokens/s (None = full speed)
    engine: str = "fast"  # one of ENGINES: which code runs each step (same maths, same tokens); the API's backend
    chat: bool = False  # send the prompt as a user message through the model's chat template

    @property
    def use_cache(self) -> bool:
        return self.cache_mode != "none"

    @property
    def cache_label(self) -> str:
        return CACHE_MODES.get(self.cache_mode, self.cache_mode)

    @property
    def model_key(self) -> tuple[str, str, str]:
        """What identifies a loaded model (get_model's cache key)."""
        return (self.model, self.device, self.dtype)

    def sampling(self) -> SamplingParams:
        """The sampler: greedy (the sampling fields ignored), or temperature, top-k, top-p and seed."""
        if self.greedy:
            return SamplingParams(greedy=True, seed=self.seed)
        return SamplingParams(greedy=False, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              seed=self.seed)

    def cache(self) -> CacheSpec:
        """The cache: static or concat, or none (every step recomputes)."""
        return CacheSpec(use_cache=self.use_cache, kind=self.cache_mode if self.use_cache else "static")

    def generate_kwargs(self) -> dict[str, Any]:
        """``kvviz.iter_generate``'s arguments after the model (besides the capture)."""
        return {"prompt": self.prompt, "max_new_tokens": self.max_new_tokens, "sampling": self.sampling(),
                "cache": self.cache(), "backend": self.engine, "chat": self.chat}
