"""``python -m kvviz bench``: tokens/s of kvviz cached, kvviz uncached and transformers, side by side.

Every variant runs in this one process on the same weights, greedy, batch 1, with a 16-token
prompt: GPT-2 shapes on random weights (kvviz's model exported to a Hugging Face GPT-2 folder
and loaded back with ``from_pretrained``), and SmolLM2 (``smollm2``, when installed) on its
GGUF file's weights dequantized to fp32, which transformers' ``LlamaForCausalLM`` adopts as they
are (no second copy); Gemma 3 (``gemma3``, when installed) likewise, in ``Gemma3ForCausalLM``
(measure/bench_gemma3.py; kvviz.fast multiplies by the file's block codes, the same values). Runs are interleaved (variant A, B, C, then A, B, C again ...) so drift in the
machine's load hits all of them alike; each figure is the median of the repeats, with min and
max. Ratios are taken between medians of the same run. The first run of each variant is a
warm-up and is discarded. Throughput is wall-clock: prefill + every decode step + the event
bookkeeping for kvviz, ``generate()`` for transformers (CUDA synchronized before reading clocks).

``kvviz_static`` runs the accelerator (``kvviz.fast``); ``readable_static`` the same cached
generation through the readable model alone (``fast=False``), so both engines are measured.
Variants ending in ``_bf16`` run the model loaded again with bf16 weights (SmolLM2: the
accelerator widens them to fp32 as it reads), against llama.cpp on the same GGUF file (its Q4_1
weights): measured in the same run (``llama_cpp``) when ``llama-cpp-python`` is installed
here or in its own venv (``make bench-llamacpp`` compiles it for this CPU into ``.venv-llamacpp``;
the bench runs it there as a subprocess, ``measure/llamacpp.py``; never a kvviz dependency), else
issue 17's quoted figures, said to be quoted.

The ``floor`` variant runs only a decode step's weight matmuls (every layer's, then the LM head,
one row each, prepared exactly as kvviz's decode step runs them) once per token: no attention,
no norms, no model code. It is what one decode step cannot go below with these kernels at this
precision, so ``floor / hf`` bounds the speed-up any implementation could show over
transformers here.
"""
from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from kvviz.engine.api import generate
from kvviz.engine.generation.sampling import SamplingParams
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.loaded import load_model
from kvviz.engine.loading.save import export_hf_gpt2
from kvviz.engine.models.llama import Llama
from kvviz.errors import KVVizError
from kvviz.fast import rowops
from kvviz.fast.gpt2_flat import Matmul
from kvviz.fast.heap import freeze_long_lived
from kvviz.fast.llama_flat import Linear
from kvviz.measure import llamacpp
from kvviz.measure.bench_gemma3 import coded_matmuls, hf_gemma3, is_gemma3, on_codes
from kvviz.measure.cpu_load import others_busy_cores, read_cpu
from kvviz.hostinfo import cpu_name


@dataclass(frozen=True)
class Case:
    shape: str  # the table's name: a kvviz.engine.loading.loader.RANDOM_SHAPES name, or a named model
    new_tokens: int
    # kvviz_static, readable_static, kvviz_concat, kvviz_uncached, hf, floor; kvviz_static_bf16, floor_bf16
    variants: tuple[str, ...]
    model: str = ""  # what load_model loads; "" = f"random:{shape}"
    prompt_text: str | None = None  # a real model's prompt: its first prompt_len tokens


# A story opening: SmolLM2 continues it for 64 tokens without an end-of-turn token.
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
         "told the children stories every evening.")
CASES = (
    Case("tiny", 256, ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor")),
    Case("gpt2-small", 64, ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor")),
    Case("tiny", 512, ("kvviz_static", "kvviz_concat")),
    Case("smollm2", 64, ("kvviz_static", "readable_static", "kvviz_uncached", "hf", "floor", "floor_fp32",
                         "kvviz_static_bf16", "floor_bf16"), model="smollm2", prompt_text=STORY),
    # floor_bf16: the same matmuls on bf16 weights (the C kernel widens them as it reads): how far a
    # bf16 step could go, where the fp32 floor bounds the speed-up over transformers below 3x.
    # Gemma 3: floor is the coded matmuls kvviz.fast runs; floor_fp32 the same on the fp32 weights.
    Case("gemma3", 64, ("kvviz_static", "readable_static", "hf", "floor", "floor_fp32"), model="gemma3",
         prompt_text=STORY),
)
# llama.cpp on SmolLM2's Q4_1 file (93.8 MiB streamed per token), on a 2-core CPU, by thread count,
# as issue 17 quotes them: the comparison when llama-cpp-python is not installed to measure it.
LLAMA_CPP_Q4_1 = {1: 68.0, 2: 99.0}
LLAMA_CPP_SOURCE = "llama.cpp, SmolLM2-135M-Instruct Q4_1, 64 new tokens, quoted from issue 17 (not measured here)"
LLAMA_CPP = "llama_cpp"  # the measured variant's name (on SmolLM2's Q4_1 file and Gemma 3's Q4_K_M alike)
DECODE = "kvviz_static_decode"  # kvviz_static's decode steps alone, where a floor is measured beside it


def have_llama_cpp() -> bool:
    """llama.cpp at hand: llama-cpp-python importable, or its own venv (``make bench-llamacpp``)."""
    return llamacpp.available()


def _llama_cpp_runner(model: LoadedModel, prompt: list[int], n: int) -> Callable[[], list[int]]:
    """llama.cpp on the GGUF file ``model`` was loaded from (its own quantized weights), greedy,
    at torch's thread count, prompt ids as given, n tokens (``measure/llamacpp.py``)."""
    return llamacpp.runner(str(model.source), prompt, n, torch.get_num_threads())


def machine_info(device: torch.device) -> dict[str, Any]:
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "row_kernel": rowops.status()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _hf_llama(model: LoadedModel) -> Any:
    """transformers' model of the same family (Llama, Mistral, Qwen2, Qwen3) holding kvviz's own
    tensors (assigned, not copied)."""
    import transformers

    c = model.config
    family = getattr(c, "family", "llama")
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]
    HFConfig, HFModel = (getattr(transformers, n) for n in names)
    extra: dict[str, Any] = {"sliding_window": c.sliding_window} if family == "mistral" else {}
    if family in ("llama", "qwen3"):  # Qwen2 has no attention_bias switch: its q/k/v biases are fixed
        extra.update(attention_bias=c.attention_bias)
    if family == "llama":
        extra.update(mlp_bias=c.mlp_bias)
    cfg = HFConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.intermediate_size,
                   num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads,
                   head_dim=c.head_dim, max_position_embeddings=c.block_size, rms_norm_eps=c.rms_norm_eps,
                   rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
                   tie_word_embeddings=c.tie_word_embeddings, bos_token_id=None, eos_token_id=None,
                   pad_token_id=None, **extra)
    hf = HFModel(cfg).to(dtype=model.dtype)
    hf.load_state_dict(model.model.state_dict(), strict=True, assign=True)
    hf.tie_weights()
    return hf.to(model.device).eval()


def _hf_model(model: LoadedModel, folder: Path) -> Any:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise KVVizError("the transformers baseline needs `pip install -r requirements-dev.txt` "
                         "(or run with --no-hf)") from None
    if isinstance(model.model, Llama):
        hf = _hf_llama(model)
    elif is_gemma3(model):
        hf = hf_gemma3(model)
    else:
        from transformers import GPT2LMHeadModel

        export_hf_gpt2(model.model, folder)
        hf = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).to(model.device).eval()
    hf.generation_config.eos_token_id = None  # run exactly new_tokens steps, like kvviz
    hf.generation_config.pad_token_id = 0
    return hf


def weight_matmuls(model: LoadedModel, fp32: bool = False) -> list[Matmul | Linear]:
    """Every matmul of a decode step, in order (each layer's fused calls, then the LM head),
    prepared as the flat decode step runs them for the current thread count."""
    return _step_matmuls(model, fp32)[0]


def _step_matmuls(model: LoadedModel, fp32: bool = False) -> tuple[list[Matmul | Linear], int, bool]:
    """The step's matmuls, the thread count they run at, and whether the C row kernel runs them.
    Gemma 3: the block codes its accelerator reads, or with ``fp32`` the readable model's weights."""
    if on_codes(model):  # Gemma 3, a Llama-family GGUF: the block codes the step reads (or with fp32 the weights)
        return list(coded_matmuls(model, coded=not fp32)), torch.get_num_threads(), rowops.load() is not None
    plan = model.fast.plan()
    return list(plan.matmuls()), plan.threads, plan.rows is not None


def _floor_runner(model: LoadedModel, n: int, fp32: bool = False) -> Callable[[], list[int]]:
    mats, threads, in_c = _step_matmuls(model, fp32)
    dev, dt = model.device, model.dtype
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = []
    for m in mats:
        if isinstance(m, Linear):  # the Llama family: (out, in) weights, fp32 activations in C
            n_in = m.ws[0].shape[1]
            one: Any = m.row_op(threads) if in_c else None
            x_dt = torch.float32 if one is not None else dt
        else:  # GPT-2: (in, out) weights
            n_in = m.w.shape[0]
            one = rowops.row_linear(m.w, m.bias, threads) if in_c else None
            x_dt = dt
        if one is not None:  # the C kernel the step runs, without what it fuses around the matmul
            calls.append((one, torch.randn(n_in, device=dev, dtype=x_dt)))
        else:
            calls.append((m.rows, torch.randn(1, 1, n_in, device=dev, dtype=dt)))

    def run_floor() -> list[int]:
        with torch.inference_mode():
            for _ in range(n):  # one pass over the weights per generated token
                for fn, x in calls:
                    fn(x)
        return []
    return run_floor


def _runner(variant: str, model: LoadedModel, hf: Any, prompt: list[int], n: int,
            prefill_s: dict[str, float] | None = None) -> Callable[[], list[int]]:
    """One timed run of ``variant``: the ids it generated. A kvviz variant notes its last run's prefill
    (the first step's forward and sampling, in seconds) in ``prefill_s``, where given."""
    if variant.startswith("floor"):
        return _floor_runner(model, n, fp32=variant == "floor_fp32")
    if variant == LLAMA_CPP:
        return _llama_cpp_runner(model, prompt, n)
    if variant == "hf":
        ids = torch.tensor([prompt], device=model.device)

        def run_hf() -> list[int]:
            with torch.inference_mode():
                out = hf.generate(ids, max_new_tokens=n, do_sample=False, use_cache=True)
            return out[0, len(prompt):].tolist()
        return run_hf
    cache = CacheSpec(use_cache=not variant.startswith("kvviz_uncached"),
                      kind="concat" if variant.startswith("kvviz_concat") else "static")
    backend = "readable" if variant == "readable_static" else "fast"  # readable: the model's own forward
    greedy = SamplingParams(ignore_eos=True)  # exactly n steps, as transformers runs with eos_token_id unset

    def run_kvviz() -> list[int]:
        run = generate(model, prompt, max_new_tokens=n, sampling=greedy, cache=cache, backend=backend)
        if prefill_s is not None and run.events:
            prefill_s[variant] = run.events[0].latency_ms / 1000.0
        return run.generated_ids
    return run_kvviz


def _timed(fn: Callable[[], list[int]], device: torch.device) -> tuple[float, list[int]]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    ids = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, ids


def _prompt(case: Case, model: LoadedModel, prompt_len: int) -> list[int]:
    if case.prompt_text is None:  # fixed ids: the same input every run
        return [(7 * i + 3) % min(256, model.config.vocab_size) for i in range(prompt_len)]
    ids = model.tokenizer.encode(case.prompt_text)
    if len(ids) < prompt_len:
        raise KVVizError(f"--prompt-len {prompt_len} is longer than the {case.shape} prompt ({len(ids)} tokens)")
    return ids[:prompt_len]


def bench_case(case: Case, repeats: int, prompt_len: int, device: str, with_hf: bool,
               new_tokens: int | None = None) -> dict[str, Any]:
    spec = case.model or f"random:{case.shape}"
    model = load_model(spec, device=device)
    variants = [v for v in case.variants if with_hf or v != "hf"]
    if str(model.source).endswith(".gguf") and have_llama_cpp():  # llama.cpp reads the same file
        variants.append(LLAMA_CPP)
    models = {v: model for v in variants}
    if any(v.endswith("_bf16") for v in variants):
        half = load_model(spec, device=device, dtype="bf16")
        models.update({v: half for v in variants if v.endswith("_bf16")})
    n = new_tokens or case.new_tokens
    prompt = _prompt(case, model, prompt_len)
    before = read_cpu()
    with tempfile.TemporaryDirectory() as tmp:
        hf = _hf_model(model, Path(tmp) / "hf") if "hf" in variants else None
        prefill_s: dict[str, float] = {}
        runners = {v: _runner(v, models[v], hf, prompt, n, prefill_s) for v in variants}
        freeze_long_lived()  # for every variant alike: no full-heap GC pauses while timing
        times: dict[str, list[float]] = {v: [] for v in variants}
        decode_times: list[float] = []  # kvviz_static's runs less their prefill
        tokens: dict[str, list[int]] = {}
        for r in range(repeats + 1):
            for v in variants:
                dt, ids = _timed(runners[v], model.device)
                tokens[v] = ids
                if r > 0:  # run 0 warms caches and allocators
                    times[v].append(dt)
                    if v == "kvviz_static" and v in prefill_s:
                        decode_times.append(dt - prefill_s[v])
    after = read_cpu()
    ref = tokens[variants[0]]
    res: dict[str, Any] = {"shape": case.shape, "new_tokens": n, "prompt_len": prompt_len,
                           "params": model.num_params, "dtype": model.dtype_name,
                           "accelerator": model.fast is not None, "variants": {}}
    if before is not None and after is not None:  # the cores other processes kept busy meanwhile
        res["others_busy_cores"] = others_busy_cores(before, after, os.sysconf("SC_CLK_TCK"))
    for v in variants:
        floor = v.startswith("floor")
        # in run order: repeat r of every variant ran back to back; a generator that stopped
        # early (an end-of-sequence token) is timed over the tokens it made
        d = res["variants"][v] = _speeds([(n if floor else len(tokens[v])) / t for t in times[v]],
                                         models[v].dtype_name, None if floor else tokens[v] == ref)
        if v == LLAMA_CPP:
            d["dtype"] = "the GGUF's own block types (llama.cpp)"
        if not floor and (models[v].dtype != model.dtype or v == LLAMA_CPP):  # other weights: tokens may part ways
            d["tokens_match"] = None
            d["same_tokens_before_divergence"] = next(
                (i for i, (a, b) in enumerate(zip(tokens[v], ref)) if a != b), min(len(tokens[v]), len(ref)))
        if floor:
            nbytes = sum(m.nbytes for m in weight_matmuls(models[v], fp32=v == "floor_fp32"))
            d["weight_bytes"] = nbytes  # streamed once per floor step
            d["GB_s_median"] = nbytes * d["tok_s_median"] / 1e9
    if "floor" in variants:
        res["weight_bytes"] = res["variants"]["floor"]["weight_bytes"]
    if "floor" in variants and decode_times and len(tokens["kvviz_static"]) > 1:
        # The floor bounds a decode step: kvviz's decode alone, the tokens after the first over the
        # run's wall time after the prefill (a 16-token prompt's prefill is compute, not a weight
        # stream: 12% of SmolLM2's run at 2 threads), with everything else the run did counted.
        res["variants"][DECODE] = _speeds([(len(tokens["kvviz_static"]) - 1) / t for t in decode_times],
                                          model.dtype_name, None)
    vs = res["variants"]
    pairs = [(f"{a}_vs_{b}" if name is None else name, a, b) for name, a, b in RATIOS if a in vs and b in vs]
    # The ratio of the medians, and the spread of the same ratio taken repeat by repeat (the two
    # runs of a pair were seconds apart, so it shows how far the machine's drift moves it).
    res["ratios"] = {k: vs[a]["tok_s_median"] / vs[b]["tok_s_median"] for k, a, b in pairs}
    res["ratio_spread"] = {}
    for k, a, b in pairs:
        per_repeat = sorted(x / y for x, y in zip(vs[a]["runs_tok_s"], vs[b]["runs_tok_s"]))
        res["ratio_spread"][k] = {"min": per_repeat[0], "max": per_repeat[-1]}
    if "kvviz_static_bf16" in vs and case.shape == "smollm2" and LLAMA_CPP not in vs:  # else measured, above
        threads = min(max(torch.get_num_threads(), 1), 2)
        quoted = LLAMA_CPP_Q4_1[threads]
        res["quoted"] = {"llama_cpp_q4_1_tok_s": quoted, "threads": threads, "source": LLAMA_CPP_SOURCE}
        res["ratios"]["kvviz_static_bf16_vs_llama_cpp_q4_1"] = vs["kvviz_static_bf16"]["tok_s_median"] / quoted
        runs_bf16 = sorted(vs["kvviz_static_bf16"]["runs_tok_s"])
        res["ratio_spread"]["kvviz_static_bf16_vs_llama_cpp_q4_1"] = {"min": runs_bf16[0] / quoted,
                                                                      "max": runs_bf16[-1] / quoted}
    return res


def _speeds(runs: list[float], dtype: str, tokens_match: bool | None) -> dict[str, Any]:
    """A variant's entry: its tokens/s run by run (in run order), their median and range."""
    tps = sorted(runs)
    return {"tok_s_median": median(tps), "tok_s_min": tps[0], "tok_s_max": tps[-1], "runs": len(tps),
            "runs_tok_s": runs, "dtype": dtype, "tokens_match": tokens_match}


# (name or None for "a_vs_b", numerator, denominator); floor / hf bounds what any implementation could gain.
RATIOS = (
    (None, "kvviz_static", "hf"),
    (None, "readable_static", "hf"),
    ("fast_vs_readable", "kvviz_static", "readable_static"),
    ("cached_vs_uncached", "kvviz_static", "kvviz_uncached"),
    (None, "kvviz_static", "floor"),
    (None, DECODE, "floor"),
    (None, "floor", "hf"),
    ("static_vs_concat", "kvviz_static", "kvviz_concat"),
    ("bf16_vs_fp32", "kvviz_static_bf16", "kvviz_static"),
    (None, "kvviz_static_bf16", "floor_bf16"),
    (None, "floor_bf16", "hf"),
    (None, "floor_fp32", "hf"),
    (None, "kvviz_static_bf16", LLAMA_CPP),  # measured; the quoted figure otherwise
    (None, "kvviz_static", LLAMA_CPP),
)
