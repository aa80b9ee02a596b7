"""load_model / save_model: named random shapes, folders, the default model, and every bad folder."""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file

import kvviz
from kvviz.engine.loading import loader as checkpoints
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loaded import load_model
from kvviz.engine.loading.save import save_model
from kvviz.engine.tokenize.tokenizer import ByteTokenizer
from kvviz import SamplingParams


def _same_weights(a: LoadedModel, b: LoadedModel) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------- random shapes
def test_random_tiny_shape_and_seeded_weights(random_models: dict[str, LoadedModel]) -> None:
    tiny = random_models["tiny"]
    c = tiny.config
    assert (c.n_layer, c.n_embd, c.n_head, c.kv_heads, c.vocab_size) == (4, 256, 4, 4, 256)
    assert random_models["tiny-gqa"].config.kv_heads == 2 and random_models["tiny-mqa"].config.kv_heads == 1
    assert _same_weights(tiny, load_model("random:tiny", device="cpu"))  # seeded: same every time
    assert isinstance(tiny.tokenizer, ByteTokenizer) and tiny.has_tokenizer
    assert tiny.name == "random:tiny" and tiny.dtype_name == "fp32" and tiny.device.type == "cpu"
    assert not tiny.model.training and not any(p.requires_grad for p in tiny.model.parameters())


def test_the_loader_returns_the_readable_model_and_load_model_adds_the_accelerator() -> None:
    """Loaders return the readable model; engine/loaded.py, above them and kvviz.fast, builds the
    accelerator (issue 38): the same weights either way, and what loading cost is stamped once."""
    readable = checkpoints.load_readable("random:tiny")
    assert readable.fast is None and "load_seconds" not in readable.info
    loaded = load_model("random:tiny")
    assert type(loaded.fast).__name__ == "FastGPT2" and loaded.info["load_seconds"] > 0
    assert loaded.info["weights_bytes"] == sum(p.nbytes for p in loaded.model.parameters())  # tied head counted once
    assert all(torch.equal(a, b) for a, b in zip(readable.model.state_dict().values(), loaded.model.state_dict().values()))
    assert kvviz.load_model is load_model


def test_gpt2_small_shape_is_gpt2s() -> None:
    c = checkpoints.RANDOM_SHAPES["gpt2-small"]
    assert (c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.block_size) == (12, 768, 12, 50257, 1024)
    assert c.eos_token_id == 50256


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_load(dtype: str, torch_dtype: torch.dtype) -> None:
    m = load_model("random:tiny", device="cpu", dtype=dtype)
    assert m.dtype_name == dtype and all(p.dtype == torch_dtype for p in m.model.parameters())
    run = kvviz.generate(m, prompt="half", max_new_tokens=4)
    assert len(run.generated_ids) == 4 and run.dtype == dtype


@pytest.mark.parametrize("spec, kwargs, needle", [
    ("random:huge", {}, "unknown random shape 'huge'"),
    ("random:tiny", {"device": "tpu"}, "unknown device"),
    ("random:tiny", {"dtype": "fp8"}, "unknown dtype"),
])
def test_bad_load_arguments(spec: str, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(kvviz.KVVizError, match=needle):
        load_model(spec, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_when_unavailable_is_a_clear_error() -> None:
    with pytest.raises(kvviz.KVVizError, match="no CUDA device"):
        load_model("random:tiny", device="cuda")
    assert load_model("random:tiny", device="auto").device.type == "cpu"


# ----------------------------------------------------------------------------- kvviz folders
@pytest.mark.parametrize("overrides", [dict(), dict(n_kv_head=1, bias=False), dict(n_kv_head=2, eos_token_id=10)])
def test_save_and_load_round_trip(make_model: Callable[..., LoadedModel], tmp_path: Path,
                                  overrides: dict[str, Any]) -> None:
    m = make_model(seed=7, **overrides)
    save_model(m.model, tmp_path / "m")
    (tmp_path / "m" / "training.json").write_text(json.dumps({"steps": 3}))
    back = load_model(tmp_path / "m", device="cpu")
    assert back.config == m.config and back.name == "m"
    assert _same_weights(back, m)
    assert isinstance(back.tokenizer, ByteTokenizer) and back.tokenizer.eos_token_id == m.config.eos_token_id
    assert back.info["training"] == {"steps": 3}
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    assert raw["model_type"] == "kvviz-gpt"


# ----------------------------------------------------------------------------- bad folders
@pytest.fixture
def good_folder(make_model: Callable[..., LoadedModel], tmp_path: Path) -> Path:
    save_model(make_model().model, tmp_path / "good")
    return tmp_path / "good"


def _edit_config(folder: Path, **changes: Any) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _load_error(folder: Path) -> str:
    with pytest.raises(kvviz.KVVizError) as e:
        load_model(folder, device="cpu")
    return str(e.value)


def test_missing_folder_and_config(tmp_path: Path, good_folder: Path) -> None:
    assert "does not exist" in _load_error(tmp_path / "nowhere")
    (good_folder / "config.json").unlink()
    assert "no config.json" in _load_error(good_folder)


@pytest.mark.parametrize("content, needle", [
    (b"{\"model_type\": \"kvviz-gpt\",", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2, 3]", "JSON object"),
    (b"{\"model_type\": \"mamba\", \"vocab_size\": 10}", "model_type 'mamba' is not supported"),
    (b"{\"model_type\": \"llama\", \"vocab_size\": 10}", "missing num_attention_heads"),  # the Llama loader
    (b"{\"vocab_size\": 10}", "model_type None is not supported"),
    (b"{\"model_type\": \"kvviz-gpt\", \"vocab_size\": 256}", "missing"),
    (b"{\"model_type\": \"gpt2\", \"vocab_size\": 256, \"n_positions\": 64, \"n_layer\": 2, \"n_head\": 3, "
     b"\"n_embd\": 32}", "n_head \\(3\\) must divide n_embd \\(32\\)"),
    (b"{\"model_type\": \"gpt2\", \"vocab_size\": 256, \"n_positions\": 64, \"n_layer\": 2, \"n_head\": 4, "
     b"\"n_embd\": 32, \"activation_function\": \"relu\"}", "activation_function 'relu'"),
    (b"{\"model_type\": \"kvviz-gpt\", \"vocab_size\": 256, \"block_size\": 64, \"n_layer\": \"two\", "
     b"\"n_head\": 4, \"n_embd\": 32}", "n_layer must be a positive integer"),
])
def test_malformed_or_unsupported_config(good_folder: Path, content: bytes, needle: str) -> None:
    (good_folder / "config.json").write_bytes(content)
    with pytest.raises(kvviz.KVVizError, match=needle):
        load_model(good_folder, device="cpu")


def test_huge_config_is_refused_before_parsing(good_folder: Path) -> None:
    (good_folder / "config.json").write_text("{" + " " * 1_100_000 + "}")
    assert "1,000,000 bytes" in _load_error(good_folder)


def test_shape_mismatch_between_config_and_weights(good_folder: Path) -> None:
    _edit_config(good_folder, n_embd=64)  # the weights are 32 wide
    msg = _load_error(good_folder)
    assert "does not match its config.json" in msg
    assert "transformer.h.0.attn.c_attn.bias has shape (96,), config.json implies (192,)" in msg


def test_missing_and_unexpected_tensors(good_folder: Path) -> None:
    _edit_config(good_folder, n_layer=3)  # the file holds 2 layers
    assert "missing tensors: transformer.h.2" in _load_error(good_folder)
    _edit_config(good_folder, n_layer=1)
    assert "unexpected tensors: transformer.h.1" in _load_error(good_folder)


class _Tripwire:
    """Unpickling this creates a marker file: proof that someone opened the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_pickle_checkpoint_is_never_opened(good_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "unpickled"
    (good_folder / "model.safetensors").unlink()
    (good_folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Tripwire(marker)))

    def refuse(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.load was called on a pickle checkpoint")

    monkeypatch.setattr(torch, "load", refuse)
    msg = _load_error(good_folder)
    assert "no model.safetensors" in msg and "pytorch_model.bin" in msg and "never loads pickle" in msg
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated-half", "truncated-header", "empty", "garbage", "bad-header-json"])
def test_corrupt_safetensors_is_a_clear_error(good_folder: Path, damage: str) -> None:
    path = good_folder / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncated-half":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "truncated-header":
        path.write_bytes(data[:20])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(bytes(range(256)) * 50)
    else:  # a plausible length prefix followed by broken JSON
        n = int.from_bytes(data[:8], "little")
        path.write_bytes(data[:8] + b"{" * n + data[8 + n:])
    assert "is not a valid safetensors file" in _load_error(good_folder)


def test_tensors_of_the_wrong_dtype_are_converted(good_folder: Path, make_model: Callable[..., LoadedModel]) -> None:
    """A half-precision checkpoint loads as the same model (rounded), not as garbage."""
    from safetensors.torch import load_file

    sd = load_file(str(good_folder / "model.safetensors"))
    save_file({k: v.half() for k, v in sd.items()}, str(good_folder / "model.safetensors"))
    m = load_model(good_folder, device="cpu")
    ref = make_model()
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(m.model.state_dict()[k], v.half().float(), atol=0, rtol=0)


def test_bad_tokenizer_json_in_folder(good_folder: Path) -> None:
    (good_folder / "tokenizer.json").write_text("not json")
    assert "tokenizer.json" in _load_error(good_folder)


def test_tokenizer_bigger_than_the_model_vocabulary(make_model: Callable[..., LoadedModel], tmp_path: Path,
                                                    bpe_tokenizer_json: Path) -> None:
    """A 300-token tokenizer.json next to a 256-token model: refused at load, not an IndexError mid-run."""
    save_model(make_model().model, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_bytes(bpe_tokenizer_json.read_bytes())
    assert "300 tokens" in _load_error(tmp_path / "m")
    save_model(make_model(vocab_size=300).model, tmp_path / "ok")  # a vocabulary that covers it loads
    (tmp_path / "ok" / "tokenizer.json").write_bytes(bpe_tokenizer_json.read_bytes())
    m = load_model(tmp_path / "ok", device="cpu")
    assert m.tokenizer.vocab_size == 300 and m.tokenizer.encode("To be") != list(b"To be")


# ----------------------------------------------------------------------------- the default model
def test_default_means_smollm2_when_installed_else_shakespeare(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvviz.engine.loading import llama_loader

    installed = True
    try:
        llama_loader.smollm2_path()
    except kvviz.KVVizError:
        installed = False
    assert checkpoints.default_model_name() == ("smollm2" if installed else "shakespeare")

    def missing() -> None:
        raise kvviz.KVVizError("SmolLM2 is not installed")

    monkeypatch.setattr(checkpoints, "smollm2_path", missing)
    assert checkpoints.default_model_name() == "shakespeare"
    assert load_model("default", device="cpu").name == "shakespeare"


def test_default_model_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoints, "SHAKESPEARE_DIR", tmp_path / "shakespeare")
    with pytest.raises(kvviz.KVVizError, match="shakespeare model is missing"):
        load_model("shakespeare")


def test_default_model_loads_and_generates() -> None:
    # No skip: the model ships in assets/, so a path that misses it is a bug (a move once did).
    m = load_model("shakespeare", device="cpu")
    assert m.name == "shakespeare" and m.has_tokenizer and m.config.vocab_size >= 256
    assert m.config.block_size >= 512
    run = kvviz.generate(m, prompt="ROMEO:\n", max_new_tokens=80, sampling=SamplingParams(temperature=0.8, seed=0))
    assert len(run.generated_ids) == 80 and run.stop_reason == "max_new_tokens"
    # A trained byte model writes mostly printable text, unlike random weights.
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in run.text)
    assert printable / max(1, len(run.text)) > 0.95
    assert sum(ch.isalpha() for ch in run.text) > 30
