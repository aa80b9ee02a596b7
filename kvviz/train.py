"""Train kvviz's byte-level GPT (the shipped default model) on a text corpus.

AdamW with linear warmup and cosine decay, gradient clipping, a fixed seed, periodic validation
on the last 10% of the corpus's bytes, and resumable checkpoints. The resume state (weights,
optimizer moments, RNG) is stored as safetensors + JSON: like every kvviz checkpoint, no pickle.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import stat
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvviz.engine.loading.loader import load_folder, resolve_device
from kvviz.engine.loading.save import save_model
from kvviz.errors import KVVizError
from kvviz.evaluate import bits_per_byte
from kvviz.hostinfo import available_memory_bytes, cpu_name
from kvviz.engine.models.gpt2_config import GPTConfig, show
from kvviz.engine.models.gpt2 import GPT
from kvviz.engine.loading.safetensors_header import read_tensors
from kvviz.safeio import (describe_path, kind_of, parse_json, pseudo_fs, read_bounded, read_maybe_gzip, save_results,
                          write_atomic)
from kvviz.units import fmt_bytes

VAL_FRACTION = 0.1
DEFAULT_OUT = "out/shakespeare"  # never the shipped model: a bare `train` must not overwrite it
MAX_CORPUS_BYTES = 256 * 2**20  # held as int64 ids: 8 bytes of memory per corpus byte
MAX_BATCH = 4096
MAX_EVAL_BATCHES = 10_000
MAX_STATE_JSON_BYTES = 64 * 2**20  # state.json: a few hundred bytes per evaluation in its history


@dataclass(frozen=True)
class TrainConfig:
    corpus: str
    out: str = DEFAULT_OUT
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    block_size: int = 512
    dropout: float = 0.1
    batch_size: int = 16
    steps: int = 3000
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_batches: int = 8
    seed: int = 1337
    device: str = "auto"
    threads: int = 0  # 0 = torch's default
    amp: str = "bf16"  # "bf16": autocast matmuls to bfloat16 (fp32 master weights); "off": pure fp32
    final_eval: bool = True  # exact bits/byte on the whole validation split at the end


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1.0 + math.cos(math.pi * progress))


def load_corpus(path: Path) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train bytes, validation bytes, sha256): validation is the last 10% of the bytes."""
    data = read_maybe_gzip(path, MAX_CORPUS_BYTES, f"corpus {path}")
    if len(data) < 64:
        raise KVVizError(f"corpus {path} is too small to train on ({len(data)} bytes)")
    sha = hashlib.sha256(data).hexdigest()
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n_val = int(len(data) * VAL_FRACTION)
    return t[: len(data) - n_val], t[len(data) - n_val:], sha


def get_batch(data: torch.Tensor, block: int, batch: int, gen: torch.Generator, dev: torch.device):
    # Random windows; a corpus shorter than a block trains on what it has.
    T = min(block, len(data) - 1)
    ix = torch.randint(0, len(data) - T, (batch,), generator=gen)
    x = torch.stack([data[i:i + T] for i in ix])  # (B, T)
    y = torch.stack([data[i + 1:i + 1 + T] for i in ix])  # (B, T)
    return x.to(dev), y.to(dev)


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.view(-1))


@torch.no_grad()
def estimate_loss(model: GPT, data: torch.Tensor, tc: TrainConfig, dev: torch.device) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(tc.seed + 1)  # the same validation windows every time
    losses = [loss_of(model, *get_batch(data, tc.block_size, tc.batch_size, gen, dev)).item()
              for _ in range(tc.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def _save_state(path: Path, model: GPT, opt: torch.optim.Optimizer, step: int, gen: torch.Generator,
                history: list[dict], elapsed: float, tokens: int, commands: list[str]) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()
               if k != "lm_head.weight"}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"opt.{names[id(p)]}.{key}"] = st[key].detach().cpu().contiguous()
    tensors["rng"] = gen.get_state()
    tensors["torch_rng"] = torch.get_rng_state()  # dropout draws from the global generator
    save_file(tensors, str(path / "state.safetensors"))
    meta = {"step": step, "elapsed": elapsed, "tokens": tokens, "history": history, "commands": commands}
    write_atomic(path / "state.json", json.dumps(meta), "the training state")


def _load_state(path: Path, model: GPT, opt: torch.optim.Optimizer, gen: torch.Generator) -> dict:
    if not (path / "state.safetensors").is_file():
        raise KVVizError(f"--resume: no training state in {path}")
    tensors = read_tensors(path / "state.safetensors")  # the one safetensors reader: a broken file is one line
    sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model.load_state_dict(sd)
    meta = parse_json(read_bounded(path / "state.json", MAX_STATE_JSON_BYTES, "the training state"), "state.json")
    for n, p in model.named_parameters():
        if f"opt.{n}.exp_avg" in tensors:
            opt.state[p] = {
                "step": torch.tensor(float(meta["step"])),
                "exp_avg": tensors[f"opt.{n}.exp_avg"].to(p.device),
                "exp_avg_sq": tensors[f"opt.{n}.exp_avg_sq"].to(p.device),
            }
    gen.set_state(tensors["rng"])
    if "torch_rng" in tensors:
        torch.set_rng_state(tensors["torch_rng"])
    return meta


def make_optimizer(model: GPT, tc: TrainConfig) -> torch.optim.Optimizer:
    # As nanoGPT: weight decay on every matrix (embeddings included), none on biases and gains.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95))


def _model_config(tc: TrainConfig) -> GPTConfig:
    try:
        return GPTConfig(vocab_size=256, block_size=tc.block_size, n_layer=tc.n_layer, n_head=tc.n_head,
                         n_embd=tc.n_embd, dropout=tc.dropout)
    except (TypeError, ValueError) as e:
        raise KVVizError(str(e).replace("invalid GPTConfig: ", "")) from None


def _int_in(name: str, v: object, low: int, high: int) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        return f"--{name.replace('_', '-')} must be an integer in [{low:,}, {high:,}] (got {show(v)})"
    return None


def _float_in(name: str, v: object, low: float, high: float, low_open: bool = False) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
        low < v if low_open else low <= v) and v <= high
    if not ok:
        bracket = "(" if low_open else "["
        return f"--{name.replace('_', '-')} must be a number in {bracket}{low:g}, {high:g}] (got {show(v)})"
    return None


def train_problems(tc: TrainConfig) -> list[str]:
    """Every problem with a training request, found before anything is allocated or read."""
    cpus = os.cpu_count() or 1
    checks = [
        _int_in("batch_size", tc.batch_size, 1, MAX_BATCH),
        _int_in("steps", tc.steps, 1, 10**9),
        _int_in("warmup", tc.warmup, 0, 10**9),
        _int_in("eval_every", tc.eval_every, 1, 10**9),
        _int_in("eval_batches", tc.eval_batches, 1, MAX_EVAL_BATCHES),
        _int_in("seed", tc.seed, 0, 2**63 - 1),
        # torch.set_num_threads(1_000_000) segfaults; more threads than CPUs only oversubscribes.
        _int_in("threads", tc.threads, 0, cpus),
        _float_in("lr", tc.lr, 0.0, 10.0, low_open=True),
        _float_in("min_lr", tc.min_lr, 0.0, 10.0),
        _float_in("weight_decay", tc.weight_decay, 0.0, 10.0),
        _float_in("grad_clip", tc.grad_clip, 0.0, 1e6, low_open=True),
    ]
    out = [c for c in checks if c]
    try:
        cfg = _model_config(tc)
    except KVVizError as e:
        out.append(str(e))
        return out
    if not out:
        need = train_memory_bytes(cfg, tc.batch_size)
        have = available_memory_bytes()
        if resolve_device(tc.device).type == "cpu" and have is not None and need > have:
            out.append(f"this model and batch need about {fmt_bytes(need)} for training (weights, gradients, "
                       f"AdamW moments and activations); this machine has {fmt_bytes(have)} available. "
                       "Lower --batch-size, --block-size, --n-layer or --n-embd")
    return out


def train_memory_bytes(cfg: GPTConfig, batch_size: int) -> int:
    """A rough upper bound on training memory in fp32: 16 bytes per parameter (weights, grads and
    two AdamW moments) plus the activations kept for backward (~18 widths and one attention row
    per token per layer) and the logits with their gradient."""
    C, T, L, nh, V = cfg.n_embd, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.vocab_size
    params = V * C + T * C + L * 12 * C * C
    tokens = batch_size * T
    return 16 * params + 4 * tokens * (L * (18 * C + nh * T) + 3 * V)


def prepare_out(out: Path, resume: bool) -> None:
    """Create --out and prove it writable now, not at the first checkpoint an hour in."""
    mode, _ = describe_path(out)
    if mode is not None and not stat.S_ISDIR(mode):
        raise KVVizError(f"--out {out} is {kind_of(mode)}, not a folder")
    existing = next((p for p in (out.absolute(), *out.absolute().parents) if p.exists()), None)
    pseudo = pseudo_fs(existing) if existing is not None else ""
    if pseudo:  # /proc, /sys: root's mkdir there may even succeed (cgroup), but it is no place for a model
        raise KVVizError(f"--out {out} is on {pseudo}, a kernel pseudo-filesystem, not a place for files")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".kvviz-write-test-"):
            pass
    except OSError as e:
        raise KVVizError(f"--out {out} is not writable ({e.strerror or e})") from None
    if resume and not (out / "train_state" / "state.safetensors").is_file():
        raise KVVizError(f"--resume: no training state in {out / 'train_state'}")


def train(tc: TrainConfig, resume: bool = False, progress: bool = True) -> dict:
    from tqdm import tqdm

    dev = resolve_device(tc.device)
    problems = train_problems(tc)
    if problems:
        raise KVVizError("; ".join(problems))
    prepare_out(Path(tc.out), resume)
    train_data, val_data, sha = load_corpus(Path(tc.corpus))
    if tc.threads > 0:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    cfg = _model_config(tc)
    model = GPT(cfg)
    model.init_weights(torch.Generator().manual_seed(tc.seed))
    model.to(dev).train()
    opt = make_optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed)
    out = Path(tc.out)
    state_dir = out / "train_state"
    step, elapsed, tokens, history = 0, 0.0, 0, []
    commands: list[str] = []
    if resume:
        meta = _load_state(state_dir, model, opt, gen)
        step, elapsed, tokens, history = meta["step"], meta["elapsed"], meta["tokens"], meta["history"]
        commands = meta.get("commands", []) + [f"(resumed at step {step})"]
    commands.append(_command_line())

    per_step = tc.batch_size * min(tc.block_size, len(train_data) - 1)
    bar = tqdm(total=tc.steps, initial=step, disable=not progress, dynamic_ncols=True, desc="train", file=sys.stderr)
    t_last = time.perf_counter()
    while step < tc.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        x, y = get_batch(train_data, tc.block_size, tc.batch_size, gen, dev)
        with _autocast(tc, dev):
            loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        step += 1
        tokens += per_step
        now = time.perf_counter()
        elapsed += now - t_last
        t_last = now
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / max(elapsed, 1e-9):,.0f}")
        if step % tc.eval_every == 0 or step == tc.steps:
            val = estimate_loss(model, val_data, tc, dev)
            history.append({"step": step, "train_loss": round(loss.item(), 4), "val_loss": round(val, 4),
                            "elapsed_s": round(elapsed, 1)})
            # stderr: with --json, stdout carries exactly one JSON object.
            bar.write(f"step {step}: train {loss.item():.4f}  val {val:.4f}  ({elapsed / 60:.1f} min)", file=sys.stderr)
            try:
                _save_state(state_dir, model, opt, step, gen, history, elapsed, tokens, commands)
            except OSError as e:  # a full disk mid-run: one line naming what was saved last, no traceback
                last = f"; the checkpoint of step {history[-2]['step']} stays in {state_dir}" if len(history) > 1 else ""
                raise KVVizError(f"cannot save the step-{step} checkpoint to {state_dir}: {e.strerror or e}{last} "
                                 "(free space, then rerun with --resume)") from None
            t_last = time.perf_counter()  # checkpoint I/O is not training time
    bar.close()

    model.eval()
    try:
        save_model(model, out)
    except OSError as e:  # a full disk at the end: say so, and where the last checkpoint is, not a traceback
        where = f"; the checkpoint of step {history[-1]['step']} is in {state_dir} (rerun with --resume)" \
            if history else ""
        raise KVVizError(f"cannot save the trained model to {out}: {e.strerror or e}{where}") from None
    summary = {
        "steps": step,
        "tokens_seen": tokens,
        "wall_time_s": round(elapsed, 1),
        "device": _device_name(dev),
        "final_train_loss": history[-1]["train_loss"] if history else None,
        "final_val_loss_estimate": history[-1]["val_loss"] if history else None,
        "corpus": Path(tc.corpus).name,
        "corpus_sha256": sha,
        "corpus_bytes": len(train_data) + len(val_data),
        "val_split": "last 10% of the corpus bytes",
        "config": asdict(tc),
        "model": {k: v for k, v in cfg.to_dict().items()},
        "params": model.num_params(),
        "command": commands[0],
        "commands": commands,  # more than one when the run was resumed
        "history": history,
    }
    if tc.final_eval:
        lm = load_folder(out, torch.device("cpu"), torch.float32, name="trained")
        text = val_data.to(torch.uint8).numpy().tobytes().decode("utf-8", errors="ignore")
        res = bits_per_byte(lm, text)
        summary["val_bits_per_byte"] = round(res.bits_per_byte, 4)
        summary["val_nats_per_byte"] = round(res.bits_per_byte * math.log(2), 4)
    save_results(out / "training.json", json.dumps(summary, indent=2) + "\n", "the training summary")
    return summary


def _command_line() -> str:
    if sys.argv[1:2] == ["train"]:
        return "python -m kvviz train " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    return "kvviz.train.train(...) from Python"


def _autocast(tc: TrainConfig, dev: torch.device):  # type: ignore[no-untyped-def]
    # Mixed precision: 1.6x faster on an AVX512-BF16 CPU (measured), weights and optimizer in fp32.
    if tc.amp not in ("bf16", "off"):
        raise KVVizError(f"--amp must be bf16 or off (got {tc.amp!r})")
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=tc.amp == "bf16")


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    n = torch.get_num_threads()
    return f"cpu ({cpu_name()}, {n} thread{'s' if n != 1 else ''})"
