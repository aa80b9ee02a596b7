"""kvviz.fast's Gemma 3 (fast/gemma3_flat.py) on a tiny GGUF whose matrices are of every type the
block kernel reads (Q8_0, Q5_0, Q4_1, Q5_1, Q4_K, Q6_K, Q5_K): the same tokens as transformers loading
the file, logits allclose to the readable model through every cache and past the sliding window,
the same captures, and the fallbacks where codes cannot serve (changed weights, bf16, long forwards).
The real Gemma 3 270M runs through it in test_gemma3_real.py (greedy equals transformers there).

The kernels round each matmul's input rows to int16 per block of 32 (issue 42; test_gguf_codes.py
holds every call to that spec). The steps' tolerance against the readable model is then the 1e-4
(absolute and relative) of fp32 reordering plus 4x what that rounding does to the readable model's
own logits, measured by running it with every coded layer computing the kernel's maths
(``kernel_rounding``): the kernel rounds the same inputs except where the two paths' fp32 inputs
straddle a midpoint (a whole step dx there, not dx / 2: a factor 2; the other 2 is margin), as
test_fast_llama_codes.py's docstring derives.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvviz
from kvviz.engine.core.step import run_step
from kvviz.engine.generation.capture import Capture
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.loading.loader import LoadedModel
from kvviz.fast import rowops
from kvviz.fast.rowstep import LlamaStep
from kvviz.fast.blockdot import BlockDot, max_code_rows
from kvviz.fast.gemma3_flat import FastGemma3
from kvviz.fast.rowops import RowDot

from accel_checks import assert_concurrent_runs_match_sequential
from gguf_writers import GEMMA3_TOKENS, hf_tiny_gemma3, write_gemma3_gguf
from kvviz import SamplingParams
from keyword_sets import request_kwargs
from kernel_rounding import assert_records_close, kernel_rounding

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(rowops.load() is None, reason=f"no C kernel: {rowops.status()}")
# every type the block kernel reads, in the roles a Q4_K_M file gives them and more
TYPES = {"attn_q": Q.Q5_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K, "ffn_gate": Q.Q5_1,
         "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}


def hf_tiny() -> Any:
    return hf_tiny_gemma3(seed=3)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_gguf(tmp_path_factory.mktemp("fastgemma") / "tiny-kq.gguf", hf_tiny(), types=TYPES)


@pytest.fixture(scope="module")
def tiny(tiny_file: Path) -> LoadedModel:
    return kvviz.load_model(str(tiny_file))


def test_every_matmul_reads_the_files_codes(tiny: LoadedModel) -> None:
    assert isinstance(tiny.fast, FastGemma3)
    p = tiny.fast.plan()
    assert p is not None and p.fp32_bytes == 0
    mats = [m for lay in p.layers for m in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [p.head]
    assert all(isinstance(m.op, BlockDot) for m in mats)  # norms, GeGLU and residuals fused in C
    # every weight a code of one byte, plus one fp32 scale per block (and an offset for Q4_1, Q5_1, Q4_K, Q5_K)
    c = tiny.config
    assert p.coded_bytes == sum(w.nbytes for w in tiny.fast.codes.values())
    assert p.coded_bytes < sum(t.nbytes for n, t in tiny.model.state_dict().items() if t.dim() == 2
                               and n != "lm_head.weight") / 2
    assert tiny.info["codes_bytes"] == p.coded_bytes and c.n_layer == 6


def test_greedy_equals_transformers_on_the_same_file(tiny: LoadedModel, tiny_file: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name,
                                                           dtype=torch.float32).eval()
    ids = torch.randint(4, len(GEMMA3_TOKENS), (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 6:].tolist()
    # 6 + 24 positions: the window of 8 is in force for most steps
    for kw in ({"cache_kind": "static"}, {"cache_kind": "paged"}, {"cache_kind": "concat"}, {"use_cache": False}):
        run = kvviz.generate(tiny,
                             **request_kwargs(prompt_ids=ids[0].tolist(), max_new_tokens=24, ignore_eos=True, **kw))
        assert run.engine == "fast" and run.generated_ids == want, kw


def test_captured_attention_is_transformers_eager_attention(tiny: LoadedModel, tiny_file: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights the live views show, against transformers' own (eager attention, the same file):
    scaled by query_pre_attn_scalar ** -0.5 (256 here, head_dim 64: 1/16, not 1/8), the sliding
    layers' keys outside the window at zero. The fast path's first steps come out of the one-call C
    step (no ring has wrapped yet); past the window of 8, and on the readable model, the capture
    computes them from q and K. float16 records: 2e-3 absolute."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_file.parent, gguf_file=tiny_file.name,
                                                           dtype=torch.float32, attn_implementation="eager").eval()
    prompt = [5, 6, 7, 8]
    one_call: list[int] = []
    real = LlamaStep.decode
    monkeypatch.setattr(LlamaStep, "decode", lambda self, x, pos, *a: one_call.append(pos) or real(self, x, pos, *a))
    for backend in ("fast", "readable"):
        run = kvviz.generate(tiny, prompt=prompt, max_new_tokens=8, capture=Capture(attention=True), backend=backend,
                             sampling=SamplingParams(ignore_eos=True))
        assert one_call == [4, 5, 6, 7]  # positions 4-7 in one call each (the readable run adds none); a ring of 8 wraps at 8
        ids = prompt + run.generated_ids
        for step, e in enumerate(run.events[1:], start=1):  # decode steps: one new query row each
            t = len(prompt) + step  # the positions it attends to, itself included
            with torch.inference_mode():
                out = hf(torch.tensor([ids[:t]]), output_attentions=True)
            want = torch.stack([a[0, :, -1, :] for a in out.attentions])  # (L, nh, t)
            assert e.attn is not None and e.attn.shape == tuple(want.shape), (backend, step)
            assert float(abs(torch.from_numpy(e.attn.astype("float32")) - want).max()) < 2e-3, (backend, step)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", ["static", "paged", "concat"])
def test_decode_steps_equal_the_readable_model_past_the_window(tiny: LoadedModel, kind: str, threads: int) -> None:
    c = tiny.config
    ids = torch.randint(4, c.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    out = {}
    for name in ("fast", "readable", "rounded"):  # each step through the step driver on that backend
        cache = make_cache(kind, c, 2, "cpu", torch.float32)
        steps = []
        backend = "fast" if name == "fast" else "readable"
        with torch.inference_mode(), kernel_rounding(tiny.model, tiny.fast.codes if name == "rounded" else {}):
            steps.append(run_step(tiny, cache, ids[:, :4], torch.arange(4), backend=backend))  # 8 rows: the kernels
            for t in range(4, 20):  # one token per row per step, to position 19 (window 8)
                steps.append(run_step(tiny, cache, ids[:, t:t + 1], torch.tensor([t]), backend=backend))
        out[name] = torch.cat(steps, dim=1)
    rounding = float((out["rounded"] - out["readable"]).abs().max())
    assert rounding > 0  # the hooks ran
    torch.testing.assert_close(out["fast"], out["readable"], rtol=1e-4, atol=1e-4 + 4 * rounding)


def test_captures_equal_the_readable_model(tiny: LoadedModel) -> None:
    cap = Capture(attention=True, kv_norms=True, kv_layer=1)
    fast = kvviz.generate(tiny, prompt=[5, 6, 7, 8], max_new_tokens=12, capture=cap,
                          sampling=SamplingParams(ignore_eos=True))
    slow = kvviz.generate(tiny, prompt=[5, 6, 7, 8], max_new_tokens=12, capture=cap, backend="readable",
                          sampling=SamplingParams(ignore_eos=True))
    assert (fast.engine, slow.engine) == ("fast", "readable")
    assert fast.generated_ids == slow.generated_ids
    for a, b in zip(fast.events, slow.events):
        for field in ("attn", "kv_norms", "kv_values"):
            x, y = getattr(a, field), getattr(b, field)
            assert x is not None and x.shape == y.shape, field
            assert_records_close(x, y, field)
        assert list(a.cache_layer_bytes) == list(b.cache_layer_bytes)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_long_forwards_run_the_readable_model(tiny: LoadedModel, threads: int) -> None:
    limit = max_code_rows(threads, "gemma3")
    ids = torch.randint(4, tiny.config.vocab_size, (1, limit + 1), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert torch.equal(tiny.fast.forward(ids), tiny.model(ids))  # the same code, the same bits
        assert not torch.equal(tiny.fast.forward(ids[:, :limit]), tiny.model(ids[:, :limit]))  # the kernels
        # A prefill that keeps the last row only: the readable layers, the head on the file's codes
        last = tiny.fast.forward(ids, last_only=True)
        head = tiny.fast.plan().head
        assert torch.equal(last, head(tiny.model.hidden(ids, last_only=True).contiguous()).view(1, 1, -1))
        want = tiny.model(ids, last_only=True)
        # the sums' order (2e-5 of the largest logit) plus 4x what the head's int16 rounding of its
        # input does to these logits (the module docstring): the readable head computing the kernel's maths
        head_codes = {k: v for k, v in tiny.fast.codes.items() if k == "model.embed_tokens.weight"}
        with kernel_rounding(tiny.model, head_codes):
            rounded = tiny.model(ids, last_only=True)
        slack = 4 * float((rounded - want).abs().max())
        assert slack > 0  # the hook ran
        torch.testing.assert_close(last, want, rtol=0, atol=2e-5 * float(want.abs().max()) + slack)


def test_codes_that_no_longer_match_fall_back_to_fp32(tiny_file: Path) -> None:
    m = kvviz.load_model(str(tiny_file))
    net = m.model.model
    changed = (net.layers[2].self_attn.o_proj.weight, net.layers[3].mlp.gate_proj.weight, net.embed_tokens.weight,
               net.layers[1].self_attn.k_proj.weight)
    with torch.no_grad():
        for w in changed:
            w[0, 0] += 0.5  # the codes no longer rebuild these parameters
    m.fast.rebuild()
    p = m.fast.plan()
    # each falls back to the fp32 row kernel, its GeGLU and output norm in PyTorch
    assert isinstance(p.layers[2].o.op, RowDot) and isinstance(p.layers[1].o.op, BlockDot)
    assert isinstance(p.layers[3].gate_up.op, RowDot) and isinstance(p.head.op, RowDot)
    assert not p.layers[1].qkv.rotates and p.layers[0].qkv.rotates  # q/k norms and RoPE back in PyTorch
    attn = net.layers[1].self_attn
    assert p.fp32_bytes == sum(w.nbytes for w in changed) + net.layers[3].mlp.up_proj.weight.nbytes + \
        attn.q_proj.weight.nbytes + attn.v_proj.weight.nbytes
    ids = torch.tensor([[5, 9, 11]])
    with torch.inference_mode():
        torch.testing.assert_close(m.fast.forward(ids), m.model(ids), rtol=1e-4, atol=1e-4)


def test_bf16_runs_the_readable_model(tiny_file: Path) -> None:
    m = kvviz.load_model(str(tiny_file), dtype="bf16")
    assert isinstance(m.fast, FastGemma3) and m.fast.codes == {} and m.fast.plan() is None
    ids = torch.tensor([[5, 9, 11]])
    with torch.inference_mode():
        assert torch.equal(m.fast.forward(ids), m.model(ids))


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_concurrent_streams_match_sequential_runs(tiny: LoadedModel, threads: int) -> None:
    assert_concurrent_runs_match_sequential(tiny, [[5, 6, 7], [40, 41, 42, 43, 44], [9] * 9], 16)


def test_the_bench_floor_reads_the_codes_the_step_reads(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvviz.measure import bench
    from kvviz.measure.bench_gemma3 import CodedLinear, gemma3_matmuls

    coded, fp32 = gemma3_matmuls(tiny), gemma3_matmuls(tiny, coded=False)
    assert all(isinstance(m, CodedLinear) for m in coded) and not any(isinstance(m, CodedLinear) for m in fp32)
    assert sum(m.nbytes for m in coded) == tiny.fast.plan().coded_bytes
    assert sum(m.nbytes for m in fp32) == 4 * sum(t.numel() for n, t in tiny.model.state_dict().items()
                                                  if t.dim() == 2 and n != "lm_head.weight")
    calls: list[int] = []
    real = BlockDot.__call__
    monkeypatch.setattr(BlockDot, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    bench._floor_runner(tiny, 2)()
    assert len(calls) == 2 * (6 * 4 + 1)  # per token: four calls per layer and the head
    bench._floor_runner(tiny, 2, fp32=True)()
    assert len(calls) == 2 * (6 * 4 + 1)  # the fp32 floor reads no codes
