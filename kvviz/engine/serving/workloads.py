"""Workloads for the serving engine: a JSON Lines file, or a built-in one made from a seed.

A workload file holds one JSON object a line: ``id``; ``prompt`` (text; with ``"chat": true`` sent
through the model's chat template) or ``prompt_ids``; ``max_tokens``; ``ignore_eos``; ``arrival``
(steps or seconds, as the run counts them); optional ``stop`` (a string or a list) and sampling
fields ``temperature``, ``top_k``, ``top_p``, ``seed`` (greedy unless ``temperature`` is given).
Blank lines are skipped; every other problem names its line.

The built-ins draw from ``assets/serve_prompts.json`` (real prompts, the chat template applied when
the model has one) with ``random.Random(seed)``, so the same seed gives the same workload:
- ``mixed``: every request at step 0, outputs of 8 to 64 tokens (mixed lengths: the Orca lesson);
- ``shared-prefix``: one system prompt before every question, a request every 2 steps;
- ``long-tail``: most outputs short (8 to 16 tokens), one in eight long (96 to 128), all at step 0.
"""
from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvviz.engine.generation.request import resolve_chat
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.serving.requests import ServeRequest
from kvviz.errors import KVVizError
from kvviz.limits import MAX_TOKEN_ID, MAX_TOKENS
from kvviz.paths import ASSETS
from kvviz.safeio import parse_json, read_bounded

if TYPE_CHECKING:
    from kvviz.engine.loading.loader import LoadedModel

BUILTIN = ("mixed", "shared-prefix", "long-tail")
PROMPTS_FILE = ASSETS / "serve_prompts.json"
MAX_WORKLOAD_BYTES = 64 << 20
MAX_REQUESTS = 10_000
FIELDS = {"id", "prompt", "prompt_ids", "chat", "max_tokens", "ignore_eos", "arrival", "stop",
          "temperature", "top_k", "top_p", "seed"}


def shipped_prompts() -> tuple[str, list[str]]:
    data = json.loads(PROMPTS_FILE.read_text(encoding="utf-8"))
    return data["system"], list(data["prompts"])


def encode(model: "LoadedModel", text: str, chat: bool, system: str | None = None) -> list[int]:
    """A prompt's ids: the chat template's layout when asked (a system message first, if given)."""
    if not text:
        raise KVVizError("a request's prompt is empty")
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rows, _ = resolve_chat(model, None, None, msgs)
        return rows[0]
    if not getattr(model, "has_tokenizer", True):
        raise KVVizError(f"model {model.name!r} has no tokenizer: give prompt_ids")
    return model.tokenizer.encode(text)


def builtin(name: str, model: "LoadedModel", n: int = 64, seed: int = 0) -> list[ServeRequest]:
    if name not in BUILTIN:
        raise KVVizError(f"unknown built-in workload {name!r}: one of {', '.join(BUILTIN)}")
    if not 1 <= n <= MAX_REQUESTS:
        raise KVVizError(f"a workload has 1..{MAX_REQUESTS} requests (got {n})")
    rng = random.Random(seed)
    system, prompts = shipped_prompts()
    chat = bool(getattr(model.tokenizer, "chat_template", None))
    out = []
    for i in range(n):
        text = prompts[rng.randrange(len(prompts))]
        if name == "mixed":
            max_tokens, arrival, sys_msg = rng.randint(8, 64), 0, None
        elif name == "shared-prefix":
            max_tokens, arrival, sys_msg = rng.randint(8, 32), 2 * i, system
        else:
            long = rng.random() < 1 / 8
            max_tokens, arrival, sys_msg = (rng.randint(96, 128) if long else rng.randint(8, 16)), 0, None
        if sys_msg and not chat:
            text = sys_msg + "\n\n" + text  # no chat template: the system prompt leads the plain text
        ids = encode(model, text, chat, sys_msg)
        out.append(ServeRequest(f"{name}-{i}", tuple(ids), max_tokens=max_tokens, ignore_eos=True, arrival=arrival,
                                prompt_text=text))
    return out


def load_workload(path: str | Path, model: "LoadedModel") -> list[ServeRequest]:
    """The requests of a JSON Lines workload file (bounded read; every problem names its line)."""
    raw = read_bounded(path, MAX_WORKLOAD_BYTES, "the workload file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KVVizError(f"the workload file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    out: list[ServeRequest] = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(out) >= MAX_REQUESTS:
            raise KVVizError(f"the workload file has more than {MAX_REQUESTS} requests")
        obj = parse_json(line, f"{path}, line {no}")
        try:
            out.append(request_from(obj, model, f"r{len(out)}"))
        except KVVizError as e:
            raise KVVizError(f"{path}, line {no}: {e}") from None
    return out


def _int(obj: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise KVVizError(f"{key} must be an integer in {low}..{high} (got {v!r})")
    return v


def request_from(obj: Any, model: "LoadedModel", default_id: str) -> ServeRequest:
    """One workload line's object -> a ServeRequest."""
    if not isinstance(obj, dict):
        raise KVVizError("each line must be a JSON object")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise KVVizError(f"unknown field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(FIELDS))}")
    rid = obj.get("id", default_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or not str(rid) or len(str(rid)) > 200:
        raise KVVizError(f"id must be a short string or integer (got {rid!r})")
    chat = obj.get("chat", False)
    if not isinstance(chat, bool):
        raise KVVizError(f"chat must be true or false (got {chat!r})")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise KVVizError("give exactly one of prompt (text) and prompt_ids")
    prompt_text = ""
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise KVVizError("prompt must be text")
        prompt_text = obj["prompt"]
        ids = encode(model, prompt_text, chat)
    else:
        if chat:
            raise KVVizError("a chat prompt is given as text (prompt), not prompt_ids")
        ids = obj["prompt_ids"]
        vocab = model.config.vocab_size
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < min(vocab, MAX_TOKEN_ID) for t in ids):
            raise KVVizError(f"prompt_ids must be a non-empty list of token ids 0..{vocab - 1}")
    stop = obj.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise KVVizError("stop must be a string or a list of non-empty strings")
    arrival = obj.get("arrival", 0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < 1e9:
        raise KVVizError(f"arrival must be a number >= 0 (got {arrival!r})")
    ignore_eos = obj.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise KVVizError(f"ignore_eos must be true or false (got {ignore_eos!r})")
    temp = obj.get("temperature")
    # Greedy unless a temperature, top_k or top_p is given; temperature 0 is greedy (vLLM's meaning).
    sampling = SamplingParams(temperature=temp, top_k=obj.get("top_k"), top_p=obj.get("top_p"),
                              seed=_int(obj, "seed", 0, 0, 2**63 - 1))
    return ServeRequest(str(rid), tuple(ids), max_tokens=_int(obj, "max_tokens", 16, 1, MAX_TOKENS), sampling=sampling,
                        ignore_eos=ignore_eos, stop=tuple(stop), arrival=arrival, prompt_text=prompt_text)
