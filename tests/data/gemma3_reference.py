"""Writes tests/data/gemma3_hf_reference.json: what transformers (fp32, loading the same GGUF and
its GGUF tokenizer) says about Gemma 3 270M, so tests/engine/test_gemma3_real.py compares kvviz with it
without loading transformers' copy of the model on every run (that costs minutes on a 2-core box).

    .venv/bin/python tests/data/gemma3_reference.py    # needs the Gemma 3 packages; ~3 minutes

Held in the file: transformers' version and the GGUF's sha256; every parameter's sha256 (fp32
bytes); token ids (plain and with split_special_tokens) and decodes of varied texts; 40 greedy
tokens on three prompts (the third over 600 tokens, past the 512-token window); and, over the third
prompt plus its continuation, the 32 largest logits at a few positions.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("gemma3_hf_reference.json")
N_NEW = 40
TOP = 32
SHORT = ["Once upon a time, there was a little", "def fibonacci(n):\n    "]
# Held out from the tokenizer's development: code, CJK, emoji (joined and skin-toned), combining
# marks, numbers, whitespace runs, tabs, CRLF, RTL, full-width, control-token look-alikes.
TEXTS = [
    "fn main() {\n\tlet x: Vec<u8> = vec![0x1F, 255];\t\t// 注释\r\n}\n\n\n"
    "Größe: 3.14159e-10 m, 1,234,567.89 €; 2026-11-27T04:00Z   —   ½ ≠ 0.5\n"
    "🏳️‍🌈 👩🏾‍💻 नमस्ते दुनिया · שלום עולם · Ελληνικά · 한국어 텍스트 · ｆｕｌｌｗｉｄｔｈ\n"
    "e\u0301 a\u0308 n\u0303 \u200b zero-width   <start_of_turn>user <0x41> [multimodal] <eos>",
    "  two leading spaces", "x\n\n\n\n\ty", "    indented\n        more\n\t\tand tabs  \n",
    "1234567890 3.14 -0.001 1e9 0b1010 ０１２", "日本語の文章とEnglishの混在。中文句子！",
]


def long_prompt() -> str:
    """The first 2,700 characters of Tiny Shakespeare: over 600 Gemma tokens."""
    with gzip.open(ROOT / "assets" / "data" / "tinyshakespeare.txt.gz", "rt", encoding="utf-8") as f:
        return f.read(2700)


def main() -> None:
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from kvviz.engine.loading.gemma3_package import SHA256, gemma3_path

    torch.set_num_threads(2)
    path = gemma3_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out: dict = {"transformers": transformers.__version__, "gguf_sha256": SHA256, "n_new": N_NEW}
    out["params"] = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                     for k, v in model.state_dict().items()}
    prompts = [*SHORT, long_prompt()]
    out["tokenizer"] = [{"text": t, "ids": tok(t).input_ids, "ids_literal": tok(t, split_special_tokens=True).input_ids,
                         "decoded": tok.decode(tok(t).input_ids)} for t in [*TEXTS, *prompts]]
    out["greedy"] = []
    with torch.inference_mode():
        for text in prompts:
            ids = tok(text, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
            out["greedy"].append({"prompt": text, "prompt_ids": ids[0].tolist(), "generated": gen[0, ids.shape[1]:].tolist()})
        full = out["greedy"][-1]["prompt_ids"] + out["greedy"][-1]["generated"]
        logits = model(torch.tensor([full])).logits[0]  # (S, V)
    n = len(full)
    positions = [0, 255, 510, 511, 512, 600, n - 41, n - 2]
    out["logits"] = {"ids": full, "positions": {}}
    for p in positions:
        v, i = logits[p].topk(TOP)
        out["logits"]["positions"][str(p)] = {"ids": i.tolist(), "values": [float(x) for x in v]}
    OUT.write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
