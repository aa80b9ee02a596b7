"""kvviz.fast's Llama family on a GGUF's block codes (fast/llama_codes.py): for every block type the
loader reads, decode steps allclose to the readable model; on tiny files of each family (llama,
qwen2, qwen3, mistral) the same greedy tokens as transformers loading the file; the fallbacks
where codes cannot serve (changed weights, bf16, long forwards); concurrent streams. The real
SmolLM2 (its Q4_1 file) runs through it in test_smollm2.py.

Tolerance of the logits (``assert_logits_close``). The kernels round each matmul's input rows to
int16 per block of 32 (issue 42, csrc/lblocks.c; test_gguf_codes.py holds each call to that spec
exactly). The readable model does not round, so the step moves away from it by what that rounding
does to these logits, which no bound on one matmul can give through two layers of an untrained net
whose final norm is scaled up tenfold (so that greedy ties are out of reach; logits reach 130).
So the test measures it: the same readable model with every coded layer computing the kernel's
maths (``kernel_rounding``: its input rounded by the spec, the offsets on the unrounded sums) gives
``rounded``, and the step must be within 2e-5 of the largest logit (the fp32 reordering allowance
this test always had: the order of additions moves logits by 0.2-4e-6 of the largest here) plus 4x
max|rounded - readable|. The kernel and ``rounded`` round the same inputs except where the two
paths' fp32 inputs straddle a rounding midpoint, which moves that input a whole step dx rather
than at most dx / 2 (a factor 2); the other 2 is margin. Measured: |step - readable| is 0.8-1.2x
max|rounded - readable|. A wrong code, scale, offset, bias, norm or rotation moves logits by far
more (the greedy tokens against transformers check that too).
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
from kvviz.fast.blockdot import BlockDot, max_code_rows
from kvviz.fast.llama_codes import FastLlamaCodes
from kvviz.fast.llama_flat import FastLlama
from kvviz.fast.rowops import RowDot
from kvviz.fast.rowstep import LlamaStep

from accel_checks import assert_concurrent_runs_match_sequential
from gguf_writers import BITS, BYTES_PER_WEIGHT, Q, write_llama_gguf
from kernel_rounding import assert_records_close, kernel_rounding
from kvviz import SamplingParams
from keyword_sets import request_kwargs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(rowops.load() is None, reason=f"no C kernel: {rowops.status()}")

PROMPT = [3, 14, 15, 92, 65]
STEPS = 10
# Rows of 256 (a K type's super-block) in every matrix: hidden 256, 4 query heads of 64 over 2 K/V
# heads, an MLP of 512.
BASE: dict[str, Any] = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                            rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.2,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {  # class, config, what the family adds
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 20000.0})),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",  # transformers' GGUF loader takes Qwen3's head_dim of 128
              dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 30000.0})),
    "mistral": ("MistralForCausalLM", "MistralConfig",  # a window of 6: decode steps slide past it
                dict(head_dim=64, sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# every type the loader keeps as codes, each in some role (output: the untied head)
MIXED = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0,
         "ffn_gate": Q.Q5_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1, "output": Q.Q6_K}
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def make_hf(family: str, seed: int, **overrides: Any) -> Any:
    cls, cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    hf = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**{**BASE, **extra, **overrides}))
    with torch.no_grad():
        hf.model.norm.weight.mul_(10.0)  # spread the logits: greedy ties are then out of reach
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(0.0, 0.5)  # zero biases and unit norms would test nothing
    return hf.eval()


def write(path: Path, hf: Any, family: str, **kw: Any) -> Path:
    """As llama.cpp writes it: Mistral as arch llama with its window, q/k rows permuted for llama."""
    arch = "llama" if family == "mistral" else family
    return write_llama_gguf(path, hf, arch, window=hf.config.sliding_window if family == "mistral" else None, **kw)


def hf_from_gguf(path: Path, hf: Any, family: str) -> Any:
    """transformers loading the file; for Mistral its class with the header's window over those
    weights (transformers' GGUF loader drops the window and loads the file as a Llama)."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    if family != "mistral":
        return ref
    out = transformers.MistralForCausalLM(hf.config)
    missing, unexpected = out.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return out.eval()


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rounded: torch.Tensor | None = None) -> None:
    """got within the module docstring's tolerance of want; rounded: want's model under ``kernel_rounding``
    (None: the step rounds nothing that want does not, e.g. both on the fp32 path)."""
    slack = 0.0 if rounded is None else 4 * float((rounded - want).abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * float(want.abs().max()) + slack)


def readable_rounded(m: LoadedModel, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """decode_steps on the readable model, its coded layers computing the kernel's maths."""
    with kernel_rounding(m.model, m.fast.codes):
        return decode_steps(m, "readable", kind, ids)


def coded_calls(m: LoadedModel) -> list[Any]:
    p = m.fast.plan()
    assert p is not None
    return [x for lay in p.layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [p.head]


def decode_steps(m: LoadedModel, backend: str, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """A prefill of 4 tokens per row (8 rows: through the kernels), then one token per row per step,
    each through the step driver on ``backend`` ("fast" or "readable")."""
    cache = make_cache(kind, m.config, ids.shape[0], "cpu", torch.float32)
    steps = []
    with torch.inference_mode():
        steps.append(run_step(m, cache, ids[:, :4], torch.arange(4), backend=backend))  # type: ignore[arg-type]
        for t in range(4, ids.shape[1]):
            steps.append(run_step(m, cache, ids[:, t:t + 1], torch.tensor([t]), backend=backend))  # type: ignore[arg-type]
    return torch.cat(steps, dim=1)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    """A qwen2 file (q/k/v biases), untied, every matrix type the loader keeps as codes."""
    hf = make_hf("qwen2", 5, tie_word_embeddings=False)
    path = write(tmp_path_factory.mktemp("llamacodes") / "qwen2-mixed.gguf", hf, "qwen2", types=MIXED)
    return kvviz.load_model(str(path)), path


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_each_block_type_steps_like_the_readable_model(tmp_path: Path, qtype: Any, threads: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    hf = make_hf("llama", 7)  # llama: the q/k rows come permuted in the file, the codes unpermuted
    m = kvviz.load_model(str(write(tmp_path / f"{qtype.name}.gguf", hf, "llama", matrix_type=qtype)))
    assert isinstance(m.fast, FastLlamaCodes) and m.info["tensor_types"][qtype.name] == 15  # 7 per layer, the tied head
    calls = coded_calls(m)
    assert all(isinstance(x.op, BlockDot) for x in calls) and calls[0].rotates  # RoPE in the q|k|v call
    assert m.fast.plan().fp32_bytes == 0 and m.fast.plan().coded_bytes == m.info["codes_bytes"]
    codes = m.fast.codes.values()  # packed where the type packs (issue 42): the bytes llama.cpp reads
    assert {c.bits for c in codes} == {BITS[qtype]}
    assert m.info["codes_bytes"] == BYTES_PER_WEIGHT[qtype] * sum(c.shape[0] * c.shape[1] for c in codes)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    for kind in ("static", "paged"):
        assert_logits_close(decode_steps(m, "fast", kind, ids), decode_steps(m, "readable", kind, ids),
                            readable_rounded(m, kind, ids))
    # One row on a static cache: every decode step is one call into C (rowstep.c on the block calls)
    calls: list[LlamaStep] = []
    real = LlamaStep.decode
    monkeypatch.setattr(LlamaStep, "decode", lambda self, *a: calls.append(self) or real(self, *a))
    assert_logits_close(decode_steps(m, "fast", "static", ids[:1]), decode_steps(m, "readable", "static", ids[:1]),
                        readable_rounded(m, "static", ids[:1]))
    assert len(calls) == ids.shape[1] - 4  # the prefill's four rows take the per-call path
    assert len({id(s) for s in calls}) == 1  # one step built per cache, not one per token


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_for_each_family(tmp_path: Path, family: str) -> None:
    hf = make_hf(family, 11, tie_word_embeddings=family != "qwen3")
    path = write(tmp_path / f"{family}.gguf", hf, family, types=MIXED)
    m = kvviz.load_model(str(path))
    ref = hf_from_gguf(path, hf, family)
    assert isinstance(m.fast, FastLlamaCodes) and (m.fast.fp32 is None) == (family in ("qwen3", "mistral"))
    assert all(isinstance(x.op, BlockDot) for x in coded_calls(m))
    idx = torch.tensor([PROMPT + [7, 1, 60]])
    with torch.inference_mode():  # 8 rows through the kernels, past Mistral's window of 6
        with kernel_rounding(ref, m.fast.codes):  # transformers computing the kernel's maths
            rounded = ref(idx).logits
        assert_logits_close(m.fast.forward(idx), ref(idx).logits, rounded)
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(PROMPT):].tolist()
    for kw in ({"cache_kind": "static"}, {"cache_kind": "paged"}, {"cache_kind": "concat"}, {"use_cache": False}):
        run = kvviz.generate(m,
                             **request_kwargs(prompt_ids=PROMPT, max_new_tokens=STEPS, greedy=True, **kw))
        assert run.engine == "fast" and run.generated_ids == want, kw


def test_captures_equal_the_readable_model(mixed: tuple[LoadedModel, Path]) -> None:
    m, _ = mixed
    cap = Capture(attention=True, kv_norms=True, kv_layer=1)
    fast = kvviz.generate(m, prompt=[5, 6, 7, 8], max_new_tokens=8, capture=cap,
                          sampling=SamplingParams(ignore_eos=True))
    slow = kvviz.generate(m, prompt=[5, 6, 7, 8], max_new_tokens=8, capture=cap, backend="readable",
                          sampling=SamplingParams(ignore_eos=True))
    assert fast.generated_ids == slow.generated_ids
    for a, b in zip(fast.events, slow.events):
        for field in ("attn", "kv_norms", "kv_values"):
            x, y = getattr(a, field), getattr(b, field)
            assert x is not None and x.shape == y.shape, field
            assert_records_close(x, y, field)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_long_forwards_take_the_fp32_path(mixed: tuple[LoadedModel, Path], threads: int) -> None:
    m, _ = mixed
    assert isinstance(m.fast.fp32, FastLlama)
    limit = max_code_rows(threads, "llama")
    ids = torch.randint(0, 96, (1, limit + 1), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(limit + 1)
    with torch.inference_mode():
        got = m.fast.forward(ids, pos)
        assert torch.equal(got, m.fast.fp32.forward(ids, pos))  # the same code, the same bits
        # the fallback is the readable model's maths on fp32 weights: fp32 reordering apart (the
        # tolerance of assert_logits_close with nothing rounded)
        assert_logits_close(got, m.model(ids, pos))
        short = ids[:, :limit]
        assert not torch.equal(m.fast.forward(short), m.fast.fp32.forward(short, pos[:limit]))  # the codes


def test_codes_that_no_longer_match_fall_back_to_fp32(mixed: tuple[LoadedModel, Path]) -> None:
    _, path = mixed
    m = kvviz.load_model(str(path))
    net = m.model.model
    changed = (net.layers[1].self_attn.k_proj.weight, net.layers[0].mlp.up_proj.weight, m.model.lm_head.weight)
    with torch.no_grad():
        for w in changed:
            w[0, 0] += 0.5  # the codes no longer rebuild these parameters
    m.fast.rebuild()
    p = m.fast.plan()
    assert isinstance(p.layers[1].qkv.op, RowDot) and not p.layers[1].qkv.rotates  # RoPE back in PyTorch
    assert p.layers[0].qkv.rotates and isinstance(p.layers[0].gate_up.op, RowDot)  # SwiGLU in the row kernel
    assert isinstance(p.head.op, RowDot) and isinstance(p.layers[1].gate_up.op, BlockDot)
    attn = net.layers[1].self_attn
    assert p.fp32_bytes == sum(w.nbytes for w in changed) + net.layers[0].mlp.gate_proj.weight.nbytes + \
        attn.q_proj.weight.nbytes + attn.v_proj.weight.nbytes
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(6))
    assert_logits_close(decode_steps(m, "fast", "static", ids), decode_steps(m, "readable", "static", ids),
                        readable_rounded(m, "static", ids))


def test_bf16_keeps_no_codes(mixed: tuple[LoadedModel, Path]) -> None:
    m = kvviz.load_model(str(mixed[1]), dtype="bf16")
    assert isinstance(m.fast, FastLlama) and m.info["codes_bytes"] == 0  # the fp32 accelerator, widening as it reads
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(m.fast.forward(ids, torch.arange(len(PROMPT))),
                           m.fast.forward(ids, torch.arange(len(PROMPT))))


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_concurrent_streams_match_sequential_runs(mixed: tuple[LoadedModel, Path], threads: int) -> None:
    assert_concurrent_runs_match_sequential(mixed[0], [[5, 6, 7], [40, 41, 42, 43, 44], [9] * 9], 12)


def test_the_bench_floor_reads_the_codes_the_step_reads(mixed: tuple[LoadedModel, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvviz.measure import bench
    from kvviz.measure.bench_gemma3 import CodedLinear, coded_matmuls

    m, _ = mixed
    coded, fp32 = coded_matmuls(m), coded_matmuls(m, coded=False)
    assert all(isinstance(x, CodedLinear) for x in coded) and not any(isinstance(x, CodedLinear) for x in fp32)
    assert sum(x.nbytes for x in coded) == m.fast.plan().coded_bytes
    # every matrix but the embedding (a lookup: the head is untied here)
    assert sum(x.nbytes for x in fp32) == 4 * sum(t.numel() for n, t in m.model.state_dict().items()
                                                  if t.dim() == 2 and n != "model.embed_tokens.weight")
    calls: list[int] = []
    real = BlockDot.__call__
    monkeypatch.setattr(BlockDot, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    bench._floor_runner(m, 2)()
    assert len(calls) == 2 * (2 * 4 + 1)  # per token: four calls per layer and the head
    bench._floor_runner(m, 2, fp32=True)()
    assert len(calls) == 2 * (2 * 4 + 1)  # the fp32 floor reads no codes
