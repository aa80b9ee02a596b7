"""llama.cpp's side of the bench, run by the Python of ``.venv-llamacpp`` (``make bench-llamacpp``):
it imports only llama-cpp-python and the standard library, never kvviz (that venv has neither torch
nor kvviz). Started as ``python llamacpp_worker.py MODEL THREADS N_CTX``, it loads the GGUF once,
prints ``ready``, then answers each stdin line ``{"prompt": [ids], "n": n}`` with one stdout line
``{"tokens": [ids]}``: n greedy tokens, no stop at the end token, as the in-process runner in
``llamacpp.py`` makes them. An empty line or end of input ends it.
"""
from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    from llama_cpp import Llama  # type: ignore[import-not-found]

    model_path, threads, n_ctx = argv[0], int(argv[1]), int(argv[2])
    llm = Llama(model_path=model_path, n_threads=threads, n_ctx=n_ctx, verbose=False)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(req["prompt"], temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == req["n"]:
                break
        print(json.dumps({"tokens": out}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
