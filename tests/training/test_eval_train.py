"""Evaluation and training: bits/byte against exact references, and a tiny training run that saves, loads and resumes."""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import kvviz

from kvviz import train as train_mod
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loaded import wrap_model
from kvviz.cli.main import main
from kvviz.evaluate import bits_per_byte
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.tokenize.tokenizer import ByteTokenizer, HFTokenizer

ROOT = Path(__file__).resolve().parents[2]
CORPUS = (
    "FIRST CITIZEN:\nBefore we proceed any further, hear me speak.\n\n"
    "ALL:\nSpeak, speak.\n\n"
    "FIRST CITIZEN:\nYou are all resolved rather to die than to famish?\n\n"
    "ALL:\nResolved. resolved.\n\n"
) * 24  # ~5 KB of repetitive play text: a 1-layer model learns it in a few dozen steps


def _uniform_model(block_size: int = 32) -> LoadedModel:
    gpt = GPT(GPTConfig(vocab_size=256, block_size=block_size, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():
        for p in gpt.parameters():
            p.zero_()  # wte = 0, so every logit is 0: a uniform distribution over 256 bytes
    return wrap_model(gpt, ByteTokenizer(), "uniform", torch.device("cpu"), torch.float32, True, "tests")


@pytest.mark.parametrize("text", ["hello world, " * 3, "x" * 200, "caf\u00e9 \U0001F642 \u05e9\u05dc\u05d5\u05dd " * 9])
def test_uniform_logits_give_exactly_8_bits_per_byte(text: str) -> None:
    res = bits_per_byte(_uniform_model(block_size=32), text)
    n = len(text.encode("utf-8"))
    assert res.tokens == res.bytes == n - 1  # every byte but the first is scored, once
    assert res.bits_per_byte == pytest.approx(8.0, abs=1e-5)
    assert res.nats_per_token == pytest.approx(math.log(256), abs=1e-5)


def test_sliding_windows_score_every_byte_once_with_its_context(make_model: Callable[..., LoadedModel]) -> None:
    """A bigram model (logits depend on the current byte only) has an exact closed-form figure."""
    m = make_model(block_size=16, seed=2)
    with torch.no_grad():
        m.model.transformer.wpe.weight.zero_()
        for block in m.model.transformer.h:  # no attention or MLP output: the residual is wte[x]
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                proj.weight.zero_()
                proj.bias.zero_()
    gpt = m.model
    # log p(next | current) for every byte pair: (256, 256)
    with torch.no_grad():
        table = F.log_softmax(gpt.transformer.ln_f(gpt.transformer.wte.weight) @ gpt.transformer.wte.weight.T, -1)
    text = CORPUS[:300]  # ~19 windows of 16 tokens
    ids = list(text.encode())
    want = -sum(table[a, b].item() for a, b in zip(ids, ids[1:])) / math.log(2) / (len(ids) - 1)
    res = bits_per_byte(m, text)
    assert res.tokens == len(ids) - 1
    assert res.bits_per_byte == pytest.approx(want, rel=1e-5)


def test_bits_per_byte_with_a_bpe_tokenizer(bpe_tokenizer_json: Path) -> None:
    """Tokenizer-independent: total nats / ln 2 / the bytes of the scored tokens."""
    gpt = GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=1, n_head=2, n_embd=16))
    gpt.init_weights(torch.Generator().manual_seed(0))
    m = wrap_model(gpt, HFTokenizer(bpe_tokenizer_json), "bpe", torch.device("cpu"), torch.float32, True, "tests")
    text = "To be, or not to be, that is the question: whether 'tis nobler"
    ids = m.tokenizer.encode(text)
    assert len(ids) < 64
    with torch.no_grad():
        lp = F.log_softmax(m.model(torch.tensor([ids])), -1)[0]  # (T, V)
    nats = -sum(lp[i, ids[i + 1]].item() for i in range(len(ids) - 1))
    n_bytes = len(text.encode()) - len(m.tokenizer.token_bytes(ids[0]))
    res = bits_per_byte(m, text)
    assert (res.tokens, res.bytes) == (len(ids) - 1, n_bytes)
    assert res.bits_per_byte == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_eval_rejects_text_too_short(small_model: LoadedModel) -> None:
    with pytest.raises(kvviz.KVVizError, match="too short"):
        bits_per_byte(small_model, "a")


# ----------------------------------------------------------------------------- training
def _tc(tmp_path: Path, **kw: Any) -> train_mod.TrainConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(CORPUS, encoding="utf-8")
    base = dict(corpus=str(corpus), out=str(tmp_path / "out"), n_layer=1, n_head=2, n_embd=32, block_size=32,
                dropout=0.0, batch_size=8, steps=40, lr=1e-2, min_lr=1e-3, warmup=5, eval_every=10,
                eval_batches=2, device="cpu", amp="off", final_eval=False)
    return train_mod.TrainConfig(**{**base, **kw})


def test_lr_schedule() -> None:
    tc = train_mod.TrainConfig(corpus="", lr=1.0, min_lr=0.1, warmup=10, steps=110)
    assert train_mod.lr_at(0, tc) == pytest.approx(0.1)  # linear warmup from lr / warmup
    assert train_mod.lr_at(9, tc) == pytest.approx(1.0)
    assert train_mod.lr_at(10, tc) == pytest.approx(1.0)  # cosine starts at the peak
    assert train_mod.lr_at(60, tc) == pytest.approx(0.55)  # halfway: (lr + min_lr) / 2
    assert train_mod.lr_at(110, tc) == pytest.approx(0.1)


def test_corpus_split_is_the_last_10_percent_of_bytes(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_bytes(CORPUS.encode())
    tr, val, sha = train_mod.load_corpus(path)
    data = CORPUS.encode()
    assert len(val) == int(len(data) * 0.1) and len(tr) + len(val) == len(data)
    assert bytes(val.tolist()) == data[len(data) - len(val):]
    assert sha == hashlib.sha256(data).hexdigest()
    path.write_bytes(b"tiny")
    with pytest.raises(kvviz.KVVizError, match="too small"):
        train_mod.load_corpus(path)
    with pytest.raises(kvviz.KVVizError, match="does not exist"):
        train_mod.load_corpus(tmp_path / "missing.txt")


def test_tiny_training_run_lowers_the_loss_and_saves_a_loadable_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tc = _tc(tmp_path, final_eval=True)
    summary = train_mod.train(tc, progress=False)
    hist = summary["history"]
    assert [h["step"] for h in hist] == [10, 20, 30, 40]
    # A fresh model scores ln(256) = 5.55 nats; the repetitive corpus is quickly learned.
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] < math.log(256)
    assert hist[-1]["val_loss"] < 2.5 and hist[-1]["train_loss"] < 2.5
    assert summary["val_bits_per_byte"] < 4.0
    out = Path(tc.out)
    written = json.loads((out / "training.json").read_text())
    assert written["steps"] == 40 and written["tokens_seen"] == 40 * 8 * 32
    assert written["corpus_sha256"] == hashlib.sha256(CORPUS.encode()).hexdigest()
    assert {"wall_time_s", "device", "final_train_loss", "val_bits_per_byte", "command"} <= set(written)

    m = kvviz.load_model(out, device="cpu")
    assert (m.config.n_layer, m.config.n_embd, m.config.block_size, m.config.vocab_size) == (1, 32, 32, 256)
    assert m.info["training"]["steps"] == 40
    run = kvviz.generate(m, prompt="ALL:\n", max_new_tokens=20)
    assert len(run.generated_ids) == 20 and run.text == m.tokenizer.decode(run.generated_ids)
    # `eval` over the same held-out bytes reproduces the figure the training run recorded.
    capsys.readouterr()  # (drop the training run's own output)
    assert main(["eval", "--model", str(out), "--text-file", tc.corpus, "--last-fraction", "0.1", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert {"bits_per_byte", "tokens", "bytes"} <= set(obj)
    assert round(obj["bits_per_byte"], 4) == summary["val_bits_per_byte"]


def test_train_cli_json_prints_one_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` means exactly one JSON object on stdout (progress and validation lines go elsewhere)."""
    tc = _tc(tmp_path, steps=4, eval_every=2)
    argv = ["train", "--corpus", tc.corpus, "--out", tc.out, "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--block-size", "16", "--batch-size", "4", "--steps", "4", "--warmup", "1", "--eval-every", "2",
            "--eval-batches", "1", "--dropout", "0", "--amp", "off", "--device", "cpu", "--no-final-eval", "--json"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, f"stdout holds more than the JSON object: {lines[:-1]}"
    obj = json.loads(lines[0])
    assert obj["steps"] == 4 and [h["step"] for h in obj["history"]] == [2, 4]


def test_bf16_autocast_training_runs(tmp_path: Path) -> None:
    summary = train_mod.train(_tc(tmp_path, amp="bf16", steps=10, eval_every=5), progress=False)
    assert [h["step"] for h in summary["history"]] == [5, 10]
    assert all(math.isfinite(h["val_loss"]) for h in summary["history"])
    m = kvviz.load_model(Path(tmp_path / "out"), device="cpu")
    assert all(p.dtype == torch.float32 for p in m.model.parameters())  # master weights stay fp32


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _losses(history: list[dict]) -> list[tuple]:
    return [(h["step"], h["train_loss"], h["val_loss"]) for h in history]


class _Interrupted(Exception):
    pass


def test_resume_after_an_interruption_equals_an_uninterrupted_run(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    straight = train_mod.train(_tc(tmp_path / "a", steps=20, eval_every=5), progress=False)

    save_state = train_mod._save_state

    def save_then_crash(path: Path, model: Any, opt: Any, step: int, *rest: Any) -> None:
        save_state(path, model, opt, step, *rest)
        if step == 10:
            raise _Interrupted  # as if the process died right after the step-10 checkpoint

    monkeypatch.setattr(train_mod, "_save_state", save_then_crash)
    tc = _tc(tmp_path / "b", steps=20, eval_every=5)
    with pytest.raises(_Interrupted):
        train_mod.train(tc, progress=False)
    monkeypatch.setattr(train_mod, "_save_state", save_state)
    resumed = train_mod.train(tc, resume=True, progress=False)

    assert _losses(resumed["history"]) == _losses(straight["history"])
    assert resumed["tokens_seen"] == straight["tokens_seen"] == 20 * 8 * 32
    wa, wb = _weights(tmp_path / "a" / "out"), _weights(tmp_path / "b" / "out")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=1e-6)


def test_resume_extends_a_finished_run(tmp_path: Path) -> None:
    tc = _tc(tmp_path, steps=10, eval_every=5)
    first = train_mod.train(tc, progress=False)
    more = train_mod.train(replace(tc, steps=20), resume=True, progress=False)
    assert [h["step"] for h in more["history"]] == [5, 10, 15, 20]
    assert _losses(more["history"])[:2] == _losses(first["history"])
    assert more["steps"] == 20 and more["tokens_seen"] == 20 * 8 * 32
    with pytest.raises(kvviz.KVVizError, match="no training state"):
        train_mod.train(_tc(tmp_path / "fresh"), resume=True, progress=False)


@pytest.mark.parametrize("damage,message", [
    ("state.safetensors", "train_state/state.safetensors is not a valid safetensors file"),
    ("state.json", "state.json is not valid JSON"),
])
def test_a_broken_training_state_is_one_line(tmp_path: Path, damage: str, message: str) -> None:
    """--resume reads its state through the one safetensors reader and safeio (the file is the
    user's --out): a truncated file is a KVVizError naming it, not safetensors' or json's traceback."""
    tc = _tc(tmp_path, steps=5, eval_every=5)
    train_mod.train(tc, progress=False)
    state = tmp_path / "out" / "train_state" / damage
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(kvviz.KVVizError, match=message):
        train_mod.train(replace(tc, steps=10), resume=True, progress=False)


def test_the_shipped_corpus_is_the_one_the_model_trained_on() -> None:
    """assets/data holds Tiny Shakespeare gzipped: unpacked, it hashes to training.json's corpus_sha256,
    so eval and train default to exactly the text the shipped model saw (no ../shared in a clone)."""
    import hashlib
    import json

    from kvviz.engine.loading.loader import SHAKESPEARE_CORPUS, SHAKESPEARE_DIR
    from kvviz.safeio import read_maybe_gzip

    data = read_maybe_gzip(SHAKESPEARE_CORPUS, 2 * 2**20)
    meta = json.loads((SHAKESPEARE_DIR / "training.json").read_text(encoding="utf-8"))
    assert len(data) == 1_115_394 and hashlib.sha256(data).hexdigest() == meta["corpus_sha256"]


def test_gzip_reading_is_bounded_and_checked(tmp_path: Path) -> None:
    import gzip

    from kvviz.safeio import read_maybe_gzip

    bomb = tmp_path / "bomb.txt.gz"
    bomb.write_bytes(gzip.compress(b"\0" * 5_000_000))  # 5 MB from a few KB
    with pytest.raises(kvviz.KVVizError, match="more than 1,000,000 bytes uncompressed"):
        read_maybe_gzip(bomb, 1_000_000)
    cut = tmp_path / "cut.txt.gz"
    cut.write_bytes(gzip.compress(b"hello world " * 1000)[:-12])
    with pytest.raises(kvviz.KVVizError, match="truncated gzip"):
        read_maybe_gzip(cut, 1_000_000)
    junk = tmp_path / "junk.txt.gz"
    junk.write_bytes(b"not gzip at all")
    with pytest.raises(kvviz.KVVizError, match="not a valid gzip file"):
        read_maybe_gzip(junk, 1_000_000)


def test_eval_defaults_to_the_shipped_corpus() -> None:
    out = subprocess.run([sys.executable, "-m", "kvviz", "eval", "--model", "random:tiny", "--last-fraction", "0.002",
                          "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    # int(1,115,394 x 0.002) = 2,230 bytes of the tail; the first byte has no context, so 2,229 are scored.
    assert json.loads(out.stdout)["bytes"] == 2229
