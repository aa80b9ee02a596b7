"""``kvviz serve-bench``: the JSON keys the issue names, the events file, the pool in MiB, the
built-in workloads, and one clear error line (exit 2) for each bad input."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvviz import LoadedModel
from kvviz.cli.main import main
from kvviz.engine.loaded import load_model
from kvviz.engine.serving.workloads import builtin

REQUEST_KEYS = {"id", "output_ids", "output_text", "ttft_ms", "tpot_ms", "e2e_ms", "preemptions", "lost_tokens",
                "prefix_hit_tokens"}
SUMMARY_KEYS = {"throughput_tok_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p90",
                "tpot_ms_p99", "preemptions", "prefix_query_tokens", "prefix_hit_tokens", "peak_running",
                "peak_blocks_used", "blocks_leaked", "steps"}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path: Path, *lines: object) -> str:
    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(f)


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shared = list(range(40, 72))  # two blocks of 16
    wl = write(tmp_path, {"id": "a", "prompt_ids": shared + [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
               "", {"id": "b", "prompt_ids": shared + [4, 5], "max_tokens": 3, "ignore_eos": True, "arrival": 2},
               {"id": "c", "prompt": "To be, or not", "max_tokens": 2, "arrival": 9, "stop": ["\n"]})
    events = tmp_path / "ev.jsonl"
    code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", wl, "--num-blocks", "64",
                         "--max-num-batched-tokens", "32", "--json", "--events", str(events))
    assert code == 0, err
    obj = json.loads(out)
    assert [r["id"] for r in obj["requests"]] == ["a", "b", "c"]
    assert all(REQUEST_KEYS <= set(r) for r in obj["requests"])
    assert [len(r["output_ids"]) for r in obj["requests"]][:2] == [4, 3]
    s = obj["summary"]
    assert SUMMARY_KEYS <= set(s)
    # a: 35 tokens in budget 32 -> steps 0-1 prefill, tokens at steps 1-4; b at step 2 hits 32 tokens;
    # c arrives at step 9 (idle steps 5..8 between) and ends within 2 more steps.
    assert obj["requests"][1]["prefix_hit_tokens"] == 32 and s["prefix_hit_tokens"] == 32
    assert s["prefix_query_tokens"] == 35 + 34 + len("To be, or not")
    assert s["blocks_leaked"] == 0 and s["preemptions"] == 0 and s["peak_running"] == 2
    assert s["steps"] in (10, 11)  # c's prompt prefills at step 9; with 2 tokens it ends at 10 (or 9 on a stop)
    assert obj["settings"]["num_blocks"] == 64 and obj["settings"]["policy"] == "continuous"
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    steps = [x for x in lines if x["event"] == "step"]
    assert [x["step"] for x in steps] == list(range(len(steps)))
    assert [x["scheduled"] for x in steps[5:9]] == [[]] * 4  # the idle steps are recorded


def test_kv_mib_through_bytes_per_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # random:tiny: 4 layers x 4 KV heads x 64 dims x 2 (K, V) x 4 bytes = 8 KiB per token;
    # a block of 16 tokens is 128 KiB, so 1 MiB holds 8 blocks and 1.1 MiB still 8.
    wl = write(tmp_path, {"prompt_ids": [1, 2, 3], "max_tokens": 2})
    for mib, blocks in (("1", 8), ("1.1", 8), ("2", 16)):
        code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", wl, "--kv-mib", mib,
                             "--json")
        assert code == 0, err
        assert json.loads(out)["settings"]["num_blocks"] == blocks


@pytest.mark.parametrize("name", ["mixed", "shared-prefix", "long-tail"])
def test_builtin_workloads_are_deterministic(name: str) -> None:
    model = load_model("random:tiny", device="cpu")  # no chat template: the prompts' plain text
    a, b = builtin(name, model, 64, seed=3), builtin(name, model, 64, seed=3)
    assert a == b and builtin(name, model, 64, seed=4) != a
    assert len(a) == 64 and all(r.prompt_ids for r in a)
    if name == "shared-prefix":
        assert [r.arrival for r in a[:3]] == [0, 2, 4]
        assert len({r.prompt_ids[:80] for r in a}) == 1  # the system prompt (87 bytes) leads every request
    if name == "long-tail":
        assert max(r.max_tokens for r in a) >= 96 and min(r.max_tokens for r in a) <= 16


def test_builtin_prompts_go_through_the_chat_template(smollm2: LoadedModel) -> None:
    reqs = builtin("shared-prefix", smollm2, 4, seed=0)
    text = smollm2.tokenizer.decode(list(reqs[0].prompt_ids))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.") and "<|im_start|>user" in text
    common = os.path.commonprefix([list(r.prompt_ids) for r in reqs])
    assert len(common) >= 16  # the system turn is one shared prefix: a prefix-cache hit of whole blocks


@pytest.mark.parametrize("lines,extra,needle", [
    ([], [], "0 requests"),
    ([{"prompt_ids": [1] * 1000, "max_tokens": 30}], [], "past the model's context of 1024"),
    ([{"prompt_ids": [1] * 40, "max_tokens": 30}], ["--num-blocks", "4"], "pool holds 64 tokens"),
    ([{"prompt_ids": [1, 2], "max_tokens": 3}], ["--max-num-batched-tokens", "8"], "smaller than one block"),
    (["{not json"], [], "line 1"),
    ([{"prompt_ids": [1], "prompt": "x"}], [], "exactly one of prompt"),
    ([{"prompt_ids": [1], "max_tokens": 0}], [], "max_tokens must be an integer"),
    ([{"prompt_ids": [1], "colour": 1}], [], "unknown field(s) colour"),
    ([{"prompt_ids": [999]}], [], "token ids 0..255"),
    ([{"prompt_ids": [1], "arrival": -1}], [], "arrival must be a number"),
    ([{"prompt_ids": [1], "arrival": 1.5}], [], "a whole step"),
    ([{"prompt": "hi", "chat": True}], [], "no chat template"),
    ([{"prompt_ids": [1]}], ["--kv-mib", "0.01"], "holds no block"),
])
def test_bad_input_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[object],
                                     extra: list[str], needle: str) -> None:
    wl = write(tmp_path, *lines) if lines else str(tmp_path / "empty.jsonl")
    if not lines:
        Path(wl).write_text("")
    code, out, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", wl, *extra)
    assert code == 2, err
    assert "kvviz serve-bench: error:" in err and needle in err, err
    assert "Traceback" not in err


def test_missing_workload_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = cli(capsys, "serve-bench", "--model", "random:tiny", "--workload", str(tmp_path / "nope.jsonl"))
    assert code == 2 and "does not exist" in err
