"""The Llama family against transformers, on random configs saved as safetensors folders.

Each shape is a LlamaForCausalLM with random weights, saved by transformers itself and loaded
by kvviz's loader: logits must match, greedy generation must match transformers' ``generate``
token for token (uncached and with both caches), and a chunked prefill must equal a one-shot one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.capture import Capture, ForwardCapture
from kvviz.engine.api import generate
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loaded import load_model
from kvviz.engine.loading.llama_loader import LlamaLoad, load_llama_folder
from kvviz.engine.models.llama import Llama, LlamaConfig
from kvviz.errors import KVVizError
from kvviz import CacheSpec, SamplingParams

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=48,
                            rms_norm_eps=1e-5, tie_word_embeddings=True,
                            # 10x transformers' 0.02: at 0.02 a 2-layer model only repeats its last
                            # prompt token, which would make "token-exact" an empty claim.
                            initializer_range=0.2,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
SHAPES: dict[str, dict[str, Any]] = {
    "mha": {},
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "head_dim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # 4 x 32 != 64
    "untied": dict(tie_word_embeddings=False, num_key_value_heads=2),
    "rope_theta": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, num_key_value_heads=2),
    "bias": dict(attention_bias=True, mlp_bias=True, num_key_value_heads=2),
}
PROMPT = [5, 17, 3, 88, 42, 9, 61, 30]


def save_hf_llama(folder: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers Llama saved as a safetensors folder; returns the HF model."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        # Random init gives nearly flat logits; a larger final-norm gain spreads them, so greedy
        # argmax never sits on a near-tie that float noise (cached vs not) could flip.
        hf.model.norm.weight.mul_(10.0)
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)  # transformers zeroes biases; make them matter
    hf.eval()
    hf.save_pretrained(folder, safe_serialization=True)
    return hf


def load_folder(folder: Path) -> LlamaLoad:
    raw = json.loads((folder / "config.json").read_text())
    return load_llama_folder(folder, raw)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """pair(shape) -> (transformers model, kvviz LoadedModel via load_model, folder), built once."""
    made: dict[str, tuple[Any, LoadedModel, Path]] = {}

    def get(shape: str) -> tuple[Any, LoadedModel, Path]:
        if shape not in made:
            folder = tmp_path_factory.mktemp(shape)
            hf = save_hf_llama(folder, **SHAPES[shape])
            made[shape] = (hf, load_model(folder, device="cpu"), folder)
        return made[shape]

    return get


def greedy(model: LoadedModel, prompt: list[int], n: int, cache_kind: str | None) -> list[int]:
    """kvviz's generator, greedy: recomputing (None) or through a static / concat cache."""
    run = generate(model, prompt=prompt, max_new_tokens=n, sampling=SamplingParams(greedy=True),
                   cache=CacheSpec(use_cache=cache_kind is not None, kind=cache_kind or "static"))
    return run.generated_ids


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(pair: Any, shape: str) -> None:
    hf, loaded, _ = pair(shape)
    model = loaded.model
    assert isinstance(model, Llama)
    idx = torch.randint(0, BASE["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, ref = model(idx), hf(idx).logits
    assert ours.shape == (2, 20, BASE["vocab_size"])
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert model.num_params() == hf.num_parameters()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_matches_transformers_generate(pair: Any, shape: str) -> None:
    hf, model, _ = pair(shape)
    n = 24
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT):].tolist()
    assert len(ref) == n and len(set(ref)) > 3  # a real sequence, not one token repeated
    assert greedy(model, PROMPT, n, None) == ref
    assert greedy(model, PROMPT, n, "static") == ref
    assert greedy(model, PROMPT, n, "concat") == ref


@pytest.mark.parametrize("shape", ["mha", "gqa", "head_dim", "rope_theta"])
def test_chunked_prefill_equals_one_shot(pair: Any, shape: str) -> None:
    model = pair(shape)[1].model
    idx = torch.randint(0, BASE["vocab_size"], (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        one = model(idx)  # (1, 17, V), causal, no cache
        cache = make_cache("static", model.config, 1, "cpu", torch.float32)
        parts = []
        for a, b in [(0, 5), (5, 6), (6, 12), (12, 17)]:  # a decode-sized chunk among prefill ones
            parts.append(model(idx[:, a:b], torch.arange(a, b), cache))
            cache.advance(b - a)
        chunked = torch.cat(parts, dim=1)
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=1e-4)  # logits of size ~10-30
    assert cache.pos == 17


def test_capture_holds_post_rope_q_and_k(pair: Any) -> None:
    """The captured q/k give the attention weights transformers computes (eager, with RoPE)."""
    _, loaded, folder = pair("gqa")
    model = loaded.model
    hf_eager = transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    idx = torch.tensor([PROMPT])
    cfg = model.config
    with torch.inference_mode():
        fc = ForwardCapture(frozenset({0, 1}))
        model(idx, None, make_cache("static", cfg, 1, "cpu", torch.float32), fc)
        ref = hf_eager(idx, output_attentions=True).attentions  # per layer (1, nh, T, T)
    for layer in (0, 1):
        q = fc.q_last[layer][0]  # (nh, 1, hs)
        k = fc.k[layer][0].repeat_interleave(cfg.n_head // cfg.kv_heads, dim=0)  # (nh, S, hs)
        w = torch.softmax(q @ k.transpose(-1, -2) / cfg.head_dim ** 0.5, dim=-1)  # (nh, 1, S)
        torch.testing.assert_close(w[:, 0], ref[layer][0, :, -1], atol=1e-5, rtol=1e-4)


def test_generator_captures_attention_and_kv_on_llama(pair: Any) -> None:
    """kvviz's generator reads only the config and the capture API: GQA with head_dim != C/nh works."""
    loaded = pair("head_dim")[1]
    cfg = loaded.config
    run = generate(loaded, prompt=PROMPT, max_new_tokens=4,
                   capture=Capture(attention=True, kv_norms=True, kv_layer=1), sampling=SamplingParams(greedy=True))
    prefill, step = run.events[0], run.events[1]
    assert prefill.attn is not None and prefill.attn.shape == (cfg.n_layer, cfg.n_head, len(PROMPT))
    assert step.attn is not None and step.attn.shape == (cfg.n_layer, cfg.n_head, len(PROMPT) + 1)
    assert abs(float(step.attn.astype("float32").sum(-1).mean()) - 1.0) < 1e-2
    assert step.kv_values is not None and step.kv_values.shape == (2, cfg.kv_heads, 1, cfg.head_dim)
    assert prefill.kv_norms is not None and prefill.kv_norms.shape == (cfg.n_layer, 2, cfg.kv_heads, len(PROMPT))
    # The cache holds n_kv_head x head_dim per layer: 2 x 2 x 32 fp32 values x 2 layers per token.
    assert step.cache_bytes_used == (len(PROMPT) + 1) * 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * 4


def test_untied_head_is_its_own_tensor(pair: Any) -> None:
    model = pair("untied")[1].model
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    tied = pair("mha")[1].model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_random_init_is_seeded_and_runs() -> None:
    cfg = LlamaConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                      intermediate_size=48)
    a, b = Llama(cfg), Llama(cfg)
    a.init_weights(torch.Generator().manual_seed(3))
    b.init_weights(torch.Generator().manual_seed(3))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    with torch.inference_mode():
        assert a.freeze()(torch.tensor([[1, 2, 3]])).shape == (1, 3, 64)


@pytest.mark.parametrize("overrides, message", [
    (dict(n_head=6, n_kv_head=4), "must divide n_head"),
    (dict(head_dim=15), "must be even"),
    (dict(n_layer=0), "n_layer must be a positive integer"),
    (dict(vocab_size=1 << 30), "vocab_size is 1,073,741,824; kvviz allows at most 2,097,152"),
    (dict(block_size=1 << 20, head_dim=512), "precomputed RoPE tables"),
    (dict(rope_theta=float("nan")), "rope_theta must be a positive finite number"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be a positive finite number"),
    (dict(rms_norm_eps=1), "rms_norm_eps must be below 1.0"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings must be true or false"),
])
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    base = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, intermediate_size=48)
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**base, **overrides})


def _edit_config(folder: Path, **changes: Any) -> dict[str, Any]:
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    return raw


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("errors")
    save_hf_llama(folder, num_key_value_heads=2)
    return folder


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="mistral"), "model_type 'mistral' is not a Llama model"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}), "RoPE type 'llama3'"),
    (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), "RoPE type 'linear'"),
    (dict(num_hidden_layers=None), "missing num_hidden_layers"),
    (dict(num_key_value_heads=3), "must divide n_head"),
    (dict(hidden_size=128), r"embed_tokens.weight has shape \(96, 64\), config.json implies \(96, 128\)"),
    (dict(intermediate_size=100), r"layers.0.mlp.down_proj.weight has shape \(64, 112\), config.json implies \(64, 100\)"),
    (dict(num_hidden_layers=3), "missing tensors: model.layers.2"),
    (dict(num_hidden_layers=1), "unexpected tensor model.layers.1"),
    (dict(tie_word_embeddings=False), "missing tensors: lm_head.weight"),
])
def test_hf_folder_errors_name_the_problem(hf_folder: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(KVVizError, match=message):
        load_llama_folder(hf_folder, _edit_config(hf_folder, **changes))


def test_hf_folder_truncated_or_missing_weights(hf_folder: Path, tmp_path: Path) -> None:
    raw = _edit_config(hf_folder)
    data = (hf_folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(KVVizError, match="not a valid safetensors file.*incomplete"):
        load_llama_folder(tmp_path, raw)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(KVVizError, match="no model.safetensors .found pytorch_model.bin: kvviz never loads pickle"):
        load_llama_folder(tmp_path, raw)


def test_hf_folder_refuses_integer_tensors(hf_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(hf_folder / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int8)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KVVizError, match="model.norm.weight is I8; kvviz loads float tensors"):
        load_llama_folder(tmp_path, _edit_config(hf_folder))


def test_hf_folder_refuses_infinite_weights(hf_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(hf_folder / "model.safetensors"))
    sd["model.layers.0.mlp.up_proj.weight"][2, 3] = float("inf")
    sd["model.layers.0.mlp.up_proj.weight"][4, 5] = float("nan")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KVVizError, match=r"model.safetensors is damaged: model.layers.0.mlp.up_proj.weight holds 1 NaN "
                                         r"and 1 infinite values"):
        load_llama_folder(tmp_path, _edit_config(hf_folder))


def test_hf_folder_reports_cost(hf_folder: Path) -> None:
    out = load_model(str(hf_folder), device="cpu")
    m = out.model
    assert out.info["weights_bytes"] == 4 * m.num_params()  # fp32, tied head counted once
    assert out.info["load_seconds"] > 0
    half = load_model(str(hf_folder), device="cpu", dtype="bf16")  # load_model stamps the costs
    assert half.info["weights_bytes"] == 2 * m.num_params()
    assert half.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_tying_follows_the_checkpoint_when_config_json_is_silent(pair: Any, hf_folder: Path) -> None:
    """transformers' LlamaConfig default for tie_word_embeddings changed across versions; without
    the key, a stored lm_head.weight means untied and its absence means tied."""
    for folder, tied in ((hf_folder, True), (pair("untied")[2], False)):
        raw = json.loads((folder / "config.json").read_text())
        raw.pop("tie_word_embeddings")
        assert load_llama_folder(folder, raw).model.config.tie_word_embeddings is tied
