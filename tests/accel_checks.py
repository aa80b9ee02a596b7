"""What the engine suites share: decoding token by token through the accelerator, runs from several
threads against the same runs one after another, and seeded random weights for parity checks."""
from __future__ import annotations

import threading

import torch

import kvviz
from kvviz.engine.kvcache.dense import StaticKVCache
from kvviz.engine.loading.loader import LoadedModel


def decode_all(m: LoadedModel, idx: torch.Tensor, cache_cls: type = StaticKVCache) -> torch.Tensor:
    """Feed idx (B, T) one token at a time from an empty cache; logits (B, T, V)."""
    B, T = idx.shape
    cache = cache_cls(m.config, batch=B, dtype=m.dtype)
    out = []
    with torch.inference_mode():
        for t in range(T):
            out.append(m.fast.forward(idx[:, t:t + 1], torch.tensor([t]), cache=cache))  # (B, 1, V)
            cache.advance(1)
    return torch.cat(out, dim=1)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with non-zero biases and norm parameters near 1 (transformers' init makes
    them 0 and 1, which would leave bias handling untested), wide enough for varied greedy output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "ln_" in name or "norm" in name:  # GPT-2's ln_1, ln_2, ln_f; Llama's *_norm, norm
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(0.2 * noise if name.endswith("weight") else 0.05 * noise)


def assert_concurrent_runs_match_sequential(model: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    want = [kvviz.generate(model, prompt=p, max_new_tokens=max_new_tokens).generated_ids for p in prompts]
    got: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = kvviz.generate(model, prompt=prompts[i], max_new_tokens=max_new_tokens).generated_ids

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert got == want
