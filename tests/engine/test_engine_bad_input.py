"""Bad input at the engine's boundary: configs, headers, files, sampling extremes and non-finite numbers.

Every case is refused (or handled) at the boundary with a KVVizError whose message says what is
wrong, before anything big is allocated. The CLI replays of the same cases, in subprocesses where a
traceback, a hang or the memory would show, are in test_cli_bad_input.py.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import kvviz
from kvviz import KVVizError, LoadedModel
from kvviz.engine.models.gpt2_config import BOUNDS, MAX_PARAMS, GPTConfig
from kvviz.engine.generation.diagnose import NonFiniteLogits
from kvviz.engine.loading.loader import config_from_json, read_config
from kvviz.engine.loaded import load_model
from kvviz.engine.loading.save import save_model
from kvviz.engine.generation.sampling import SamplingParams, sample
from kvviz.safeio import MAX_JSON_DEPTH, json_depth, parse_json, read_bounded
from kvviz import SamplingParams
from keyword_sets import request_kwargs

TINY = dict(model_type="kvviz-gpt", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory: pytest.TempPathFactory, make_model: Callable[..., LoadedModel]) -> Path:
    """A valid kvviz folder (2 layers, 32 wide) whose weights every config case below reuses."""
    folder = tmp_path_factory.mktemp("models") / "good"
    save_model(make_model().model, folder)
    return folder


def _folder_with(tmp_path: Path, good: Path, config: Any, name: str = "bad") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(good / "model.safetensors", folder / "model.safetensors")
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "config.json").write_text(text)
    return folder


# ----------------------------------------------------------------------------- config fields
BAD_CONFIGS = [
    ({"eos_token_id": "abc"}, "eos_token_id must be a token id"),
    ({"eos_token_id": -3}, "eos_token_id must be a token id"),
    ({"eos_token_id": True}, "eos_token_id must be a token id"),
    ({"layer_norm_epsilon": "abc"}, "layer_norm_epsilon must be a number in (0, 1]"),
    ({"layer_norm_epsilon": -1e-5}, "layer_norm_epsilon must be a number"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon must be a number"),
    ({"layer_norm_epsilon": None}, "layer_norm_epsilon must be a number"),
    ({"bias": "no"}, "bias must be true or false"),
    ({"bias": 0}, "bias must be true or false"),
    ({"dropout": "0.1"}, "dropout must be in [0, 1)"),
    ({"n_layer": 1_000_000}, "n_layer is 1,000,000; kvviz allows at most 256"),
    ({"n_embd": 2**40, "n_head": 1}, "n_embd is 1,099,511,627,776"),
    ({"block_size": 10**9}, "block_size is 1,000,000,000"),
    ({"vocab_size": 10**12}, "vocab_size is"),
    ({"n_head": 1.0}, "n_head must be a positive integer"),
    ({"n_layer": [2]}, "n_layer must be a positive integer"),
    ({"n_layer": {"a": 1}}, "n_layer must be a positive integer"),
    ({"n_kv_head": "2"}, "n_kv_head must be a positive integer"),
    ({"n_embd": 16384, "n_layer": 256, "n_head": 16}, "parameters; kvviz allows at most"),
]


@pytest.mark.parametrize("patch, needle", BAD_CONFIGS)
def test_every_config_field_is_typed_and_bounded(patch: dict[str, Any], needle: str) -> None:
    with pytest.raises(KVVizError) as e:
        config_from_json({**TINY, **patch}, "x/config.json")
    assert needle in str(e.value), str(e.value)


def test_the_bounds_admit_real_models() -> None:
    xl = GPTConfig(vocab_size=50257, block_size=1024, n_layer=48, n_head=25, n_embd=1600)  # GPT-2 XL
    assert xl.n_layer <= BOUNDS["n_layer"]
    from kvviz.engine.models.gpt2_config import approx_params
    assert 1.5e9 < approx_params(xl) < MAX_PARAMS


def test_a_huge_integer_in_python_gets_a_short_message() -> None:
    with pytest.raises(ValueError, match="an integer of about 5,000 digits"):
        GPTConfig(n_layer=10**5000)


@pytest.mark.parametrize("text, needle", [
    ("[" * 100_000 + "]" * 100_000, "nested 100,000 levels deep"),
    ('{"model_type": "kvviz-gpt", "n_layer": ' + "9" * 5000 + "}", "5,000-digit integer"),
    ('{"a": "' + "[" * 1000 + '"}', None),  # brackets inside a string are not nesting
    ("\xff\xfe", "not UTF-8"),
    ('{"a": NaN}', None),
])
def test_json_is_parsed_with_bounds(text: str, needle: str | None) -> None:
    data = text.encode("latin-1") if text.startswith("\xff") else text.encode()
    if needle is None:
        parse_json(data, "x.json")
        return
    with pytest.raises(KVVizError, match=needle):
        parse_json(data, "x.json")


def test_json_depth_counts_only_structure() -> None:
    assert json_depth('{"a": [1, {"b": "[[["}]}') == 3
    assert json_depth("[]" * 5) == 1
    assert MAX_JSON_DEPTH >= 8


# ----------------------------------------------------------------------------- files
@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_read_bounded_names_each_kind_of_path(tmp_path: Path, fifo: Path) -> None:
    with pytest.raises(KVVizError, match="is a FIFO"):
        read_bounded(fifo, 100)  # and does not hang: the open is non-blocking
    with pytest.raises(KVVizError, match="is a character device"):
        read_bounded("/dev/zero", 100)  # st_size is 0: never read
    with pytest.raises(KVVizError, match="is a folder"):
        read_bounded(tmp_path, 100)
    with pytest.raises(KVVizError, match="does not exist"):
        read_bounded(tmp_path / "missing", 100)
    with pytest.raises(KVVizError, match="path of the file is empty"):
        read_bounded("", 100)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(KVVizError, match="over 100 bytes"):
        read_bounded(big, 100)
    assert read_bounded(big, 101) == b"x" * 101


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_says_permission_denied(tmp_path: Path) -> None:
    p = tmp_path / "secret"
    p.write_text("{}")
    p.chmod(0)
    with pytest.raises(KVVizError, match="permission denied"):
        read_bounded(p, 100)


def test_model_folder_messages_are_precise(tmp_path: Path, fifo: Path) -> None:
    with pytest.raises(KVVizError, match="no model given"):
        load_model("")
    with pytest.raises(KVVizError, match="model folder .* does not exist"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(KVVizError, match="is a FIFO .*not a folder"):
        load_model(str(fifo))
    (tmp_path / "m").mkdir()
    with pytest.raises(KVVizError, match="has no config.json"):
        read_config(tmp_path / "m")
    os.symlink("/dev/zero", tmp_path / "m" / "config.json")
    with pytest.raises(KVVizError, match="config.json is a character device"):
        read_config(tmp_path / "m")
    os.unlink(tmp_path / "m" / "config.json")
    os.mkfifo(tmp_path / "m" / "config.json")
    with pytest.raises(KVVizError, match="config.json is a FIFO"):
        read_config(tmp_path / "m")


# ----------------------------------------------------------------------------- header vs config
def test_a_config_that_lies_about_its_size_is_refused_from_the_header(tmp_path: Path, good_folder: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = json.loads((good_folder / "config.json").read_text())
    folder = _folder_with(tmp_path, good_folder, {**cfg, "n_layer": 100, "n_embd": 1024, "n_head": 16})
    import kvviz.engine.loading.loader as load_mod

    def no_build(*a: Any, **k: Any) -> None:
        raise AssertionError("the model was built before the header was checked")

    monkeypatch.setattr(load_mod, "read_tensors", no_build)
    with pytest.raises(KVVizError, match="does not match its config.json: missing tensors"):
        load_model(str(folder))


@pytest.mark.parametrize("edit, needle", [
    (lambda sd: {**sd, "transformer.wte.weight": sd["transformer.wte.weight"][:100]}, "has shape (100, 32)"),
    (lambda sd: {k: v for k, v in sd.items() if "h.1." not in k}, "missing tensors"),
    (lambda sd: {**sd, "transformer.h.9.extra": torch.zeros(2)}, "unexpected tensors"),
    (lambda sd: {**sd, "transformer.ln_f.weight": torch.ones(32, dtype=torch.int32)}, "holds I32 values"),
])
def test_header_mismatches_are_named(tmp_path: Path, good_folder: Path, edit: Callable, needle: str) -> None:
    from safetensors.torch import load_file, save_file

    folder = _folder_with(tmp_path, good_folder, (good_folder / "config.json").read_text())
    save_file(edit(load_file(str(good_folder / "model.safetensors"))), str(folder / "model.safetensors"))
    with pytest.raises(KVVizError, match=re.escape(needle)):
        load_model(str(folder))


@pytest.mark.parametrize("damage, needle", [
    (lambda b: b[:-100], "not a valid safetensors file"),  # truncated tensor data
    (lambda b: (10**15).to_bytes(8, "little") + b[8:], "not a valid safetensors file"),  # lying header length
    (lambda b: b"", "not a valid safetensors file"),
])
def test_damaged_weight_files_are_refused(tmp_path: Path, good_folder: Path, damage: Callable, needle: str) -> None:
    folder = _folder_with(tmp_path, good_folder, (good_folder / "config.json").read_text())
    path = folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(KVVizError, match=needle):
        load_model(str(folder))


def test_nan_weights_are_named_at_load(tmp_path: Path, good_folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _folder_with(tmp_path, good_folder, (good_folder / "config.json").read_text())
    sd = load_file(str(good_folder / "model.safetensors"))
    sd["transformer.h.1.mlp.c_fc.weight"][3, 4] = float("nan")
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(KVVizError, match=r"transformer.h.1.mlp.c_fc.weight holds 1 NaN"):
        load_model(str(folder))


# ----------------------------------------------------------------------------- sampling extremes
@pytest.mark.parametrize("temperature, top_p", [(1e-45, None), (1e-320, None), (1e-6, None), (0.8, 1e-300),
                                                (1e-45, 1e-300), (100.0, 1e-9)])
def test_extreme_sampling_values_sample_the_top_token(small_model: LoadedModel, temperature: float,
                                                      top_p: float | None) -> None:
    greedy = kvviz.generate(small_model, prompt="Hi", max_new_tokens=6)
    run = kvviz.generate(small_model, prompt="Hi", max_new_tokens=6,
                         sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=3))
    if temperature < 1e-3 or (top_p is not None and top_p < 1e-6):
        assert run.generated_ids == greedy.generated_ids  # the limit of sharpening is the argmax
    assert len(run.generated_ids) == 6


def test_sample_never_makes_nan_from_huge_finite_logits() -> None:
    logits = torch.tensor([[3e38, -3e38, 1e38, 0.0]])
    for t in (1e-45, 1e-4, 1.0, 100.0):
        ids = sample(logits, SamplingParams(greedy=False, temperature=t), torch.Generator().manual_seed(0))
        assert ids.tolist() == [0]  # the others are 1e36 or more below it: probability 0


@pytest.mark.parametrize("kw, needle", [
    (dict(temperature=float("nan")), "temperature must be in"),
    (dict(temperature=float("inf")), "temperature must be in"),
    (dict(temperature=-1.0), "temperature must be in"),
    (dict(top_p=0.0, temperature=1.0), "top_p must be in"),
    (dict(top_p=float("nan"), temperature=1.0), "top_p must be in"),
    (dict(top_k=0, temperature=1.0), "top_k must be"),
    (dict(top_k=2.5, temperature=1.0), "top_k must be"),
    (dict(seed=-1), "seed must be"),
])
def test_bad_sampling_values_are_refused(small_model: LoadedModel, kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(KVVizError, match=needle):
        kvviz.generate(small_model, **request_kwargs(prompt="Hi", max_new_tokens=2, **kw))


# ----------------------------------------------------------------------------- non-finite logits
@pytest.fixture(scope="module")
def overflowing(make_model: Callable[..., LoadedModel]) -> LoadedModel:
    """Finite weights whose layer-1 MLP output overflows float32: NaN logits from step 0."""
    m = make_model(seed=5)
    from kvviz.engine.models.gpt2 import GPT

    gpt = GPT(m.config)
    gpt.load_state_dict(m.model.state_dict())
    with torch.no_grad():
        gpt.transformer.h[1].ln_2.weight.fill_(3e38)  # its MLP input overflows to inf
    from kvviz.engine.loaded import wrap_model

    return wrap_model(gpt.eval(), m.tokenizer, "overflow", torch.device("cpu"), torch.float32, True, "tests")


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, seed=1), dict(use_cache=False),
                                dict(temperature=1.0, top_k=5, top_p=0.9)])
def test_non_finite_logits_are_named_with_step_and_layer(overflowing: LoadedModel, kw: dict[str, Any]) -> None:
    stream = kvviz.iter_generate(overflowing, **request_kwargs(prompt="Hi", max_new_tokens=4, **kw))
    with pytest.raises(NonFiniteLogits) as e:
        list(stream)
    msg = str(e.value)
    assert "the model produced" in msg and "at step 0" in msg and "first in layer 1 (transformer.h.1.ln_2)" in msg, msg
    assert "device" not in msg
    run = stream.run
    assert run.stop_reason == "error" and run.note == msg and run.generated_ids == []


@pytest.mark.parametrize("c_says_finite", [True, False])
def test_greedy_reads_the_logits_finiteness_once(make_model: Callable[..., LoadedModel],
                                                 monkeypatch: pytest.MonkeyPatch, c_says_finite: bool) -> None:
    """Greedy decoding's C argmax reads each step's finiteness in its own pass (fast/logits.py's
    argmax_checked): the loop checks the logits again only when that pass did not vouch for them
    (torch's argmax took them), once a step; sampling checks every step before it samples."""
    from kvviz.engine.core import loop, stream_base

    if c_says_finite:
        from kvviz.fast import rowops
        if rowops.load() is None:
            pytest.skip(f"no C kernel: {rowops.status()}")
    else:  # as where the kernel cannot read the logits (CUDA, bf16): torch's argmax, not checked
        monkeypatch.setattr(loop, "argmax_checked", lambda x: (torch.argmax(x, dim=-1), False))
    scans: list[int] = []
    real = stream_base.all_finite
    monkeypatch.setattr(stream_base, "all_finite", lambda x: scans.append(1) or real(x))
    m = make_model()
    kvviz.generate(m, prompt=[1, 2, 3], max_new_tokens=5, sampling=SamplingParams(ignore_eos=True))
    assert len(scans) == (0 if c_says_finite else 5)
    scans.clear()
    kvviz.generate(m, prompt=[1, 2, 3], max_new_tokens=5, sampling=SamplingParams(temperature=1.0, seed=1,
                                                                                  ignore_eos=True))
    assert len(scans) == 5


def test_a_broken_readable_model_is_found_without_the_accelerator(overflowing: LoadedModel) -> None:
    with pytest.raises(NonFiniteLogits, match=re.escape("layer 1 (transformer.h.1.ln_2)")):
        kvviz.generate(overflowing, prompt="Hi", max_new_tokens=2, backend="readable")


def test_the_diagnosis_runs_through_the_step_driver(make_llama: Callable[..., LoadedModel],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The diagnosis forward (after non-finite logits) is one uncached ``run_step`` of the readable
    model over the sequence so far (issue 38: no forward outside the step driver), for a Llama too:
    its hooks name the Llama's own module."""
    from kvviz.engine.core import stream_base
    from kvviz.engine.loaded import wrap_model
    from kvviz.engine.models.llama import Llama

    m = make_llama(seed=5)
    net = Llama(m.config)
    net.load_state_dict(m.model.state_dict())
    with torch.no_grad():
        net.model.layers[1].post_attention_layernorm.weight.fill_(3e38)  # layer 1's MLP input overflows
    broken = wrap_model(net.eval(), m.tokenizer, "overflow", torch.device("cpu"), torch.float32, True, "tests")
    calls: list[tuple[Any, Any, tuple[int, ...]]] = []
    real = stream_base.run_step

    def spy(model: Any, cache: Any, ids: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        calls.append((cache, k.get("backend"), tuple(ids.shape)))
        return real(model, cache, ids, *a, **k)

    monkeypatch.setattr(stream_base, "run_step", spy)
    with pytest.raises(NonFiniteLogits, match=re.escape("at step 0, first in layer 1 (model.layers.1.")):
        kvviz.generate(broken, prompt=[5, 6, 7], max_new_tokens=2)
    assert calls == [(None, "readable", (1, 3))]  # the three prompt tokens, no cache, the readable model


# ----------------------------------------------------------------------------- eval
def test_eval_counts_the_bytes_it_drops_and_bounds_the_file(tmp_path: Path, fifo: Path) -> None:
    from kvviz.evaluate import read_eval_text

    p = tmp_path / "t.txt"
    p.write_bytes(b"caf\xc3\xa9 \xff\xfe ok \x80")
    src = read_eval_text(p, 1.0)
    assert src.text == "café  ok " and src.dropped_bytes == 3
    with pytest.raises(KVVizError, match="is a FIFO"):
        read_eval_text(fifo, 1.0)
    with pytest.raises(KVVizError, match="character device"):
        read_eval_text(Path("/dev/zero"), 1.0)


def test_eval_refuses_non_finite_scores(overflowing: LoadedModel) -> None:
    from kvviz.evaluate import bits_per_byte

    with pytest.raises(KVVizError, match="log-probabilities are not finite"):
        bits_per_byte(overflowing, "hello there, hello there")


def test_the_cli_never_prints_nan() -> None:
    import argparse
    import io
    from contextlib import redirect_stdout

    from kvviz.cli.main import _emit

    buf = io.StringIO()
    with redirect_stdout(buf):
        _emit(argparse.Namespace(json=True), {"a": math.nan, "b": [math.inf, 1.0], "c": {"d": -math.inf}}, "")
    assert json.loads(buf.getvalue()) == {"a": None, "b": [None, 1.0], "c": {"d": None}}


# ----------------------------------------------------------------------------- the native build's cache
def _rowops_status(cache: Path) -> str:
    import subprocess
    import sys

    code = "from kvviz.fast import rowops\nprint(rowops.status())"
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root), "KVVIZ_CACHE_DIR": str(cache)})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


needs_cc = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                              reason="no C compiler")


@needs_cc
def test_a_shared_build_folder_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    status = _rowops_status(shared)
    assert "writable by other users" in status and not list(shared.iterdir()), status


# A tampered build (one byte changed) is rebuilt: tests/fast/test_rowops.py walks a build folder's life.
