"""Block codes (engine/loading/gguf_codes.py) and the block kernel (fast/blockdot.py).

The codes must rebuild every weight exactly as gguf's own dequantizer gives it, for every type the
kernel reads, packed (issue 42) or one int8 a weight; the kernel must multiply them as F.linear
multiplies those fp32 weights (allclose: only the order of the additions differs), with AVX2 and
in its portable C. Types whose blocks are random bytes cover every bit of the unpacking; the fp16
scale fields are set to finite values so the comparison is of numbers.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # noqa: E402

from kvviz.engine.loading.gguf_codes import BlockCodes, block_codes, packed_types  # noqa: E402
from kvviz.engine.loading.gguf_lite import LiteTensor  # noqa: E402
from kvviz.fast import rowops  # noqa: E402
from kvviz.fast.blockdot import block_dot  # noqa: E402

# Where each type keeps its fp16 fields (byte offsets in a block): overwritten with finite scales.
F16_AT = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
          Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_tensor(qtype: Q, out: int, n_in: int, seed: int = 0) -> LiteTensor:
    """A tensor of random blocks with finite fp16 scales, as a GGUF file would map it."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(out * n_in // block, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        blocks[:, at:at + 2] = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return LiteTensor("w", qtype, (out, n_in), blocks.reshape(out, -1))


@pytest.mark.parametrize("qtype", packed_types(), ids=lambda q: q.name)
def test_codes_rebuild_every_weight_as_gguf_dequantizes_it(qtype: Q) -> None:
    t = random_tensor(qtype, 24, 512)
    codes = block_codes(t)
    assert codes is not None
    want = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(24, 512)
    got = codes.weight().numpy()
    assert np.array_equal(got, want), f"{qtype.name}: {np.sum(got != want)} weights differ"
    assert codes.block == (16 if qtype == Q.Q6_K else 32)
    assert (codes.scales()[1] is None) == (qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q6_K))
    assert codes.bits == BITS[qtype] and codes.codes.dtype == (torch.int8 if codes.bits == 8 else torch.uint8)
    assert codes.superblock == (qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K)) and codes.shape == (24, 512)
    flat = block_codes(t, packed=False)  # one int8 a weight, fp32 scales: the same weights
    assert flat is not None and flat.bits == 8 and flat.scale.dtype == torch.float32
    assert torch.equal(flat.weight(), codes.weight()) and torch.equal(flat.codes, codes.unpacked())


# The bits a code streams in, by type: packed, Q8_0 one int8 a weight.
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}
# Bytes a weight the kernel streams, codes, scales and offsets, hand-computed from ggml's block
# structs: every type exactly its file size, as llama.cpp reads it. Legacy, per block of 32: Q4_1
# 16 bytes of nibbles + fp16 d + fp16 m = 20 / 32 = 0.625. K, per super-block of 256: Q4_K fp16 d,
# dmin + 12 bytes of 6-bit scales and mins + 128 of nibbles = 144 / 256 = 0.5625; Q5_K + 32 bytes of
# fifth bits = 176; Q6_K 128 + 64 bytes of codes + 16 int8 scales + fp16 d = 210 (0.8203125).
BYTES_PER_WEIGHT = {Q.Q4_0: 18 / 32, Q.Q4_1: 20 / 32, Q.Q5_0: 22 / 32, Q.Q5_1: 24 / 32, Q.Q8_0: 34 / 32,
                    Q.Q4_K: 144 / 256, Q.Q5_K: 176 / 256, Q.Q6_K: 210 / 256}


@pytest.mark.parametrize("qtype", packed_types(), ids=lambda q: q.name)
def test_packed_codes_stream_the_bytes_llama_cpp_reads(qtype: Q) -> None:
    t = random_tensor(qtype, 8, 512)
    codes = block_codes(t)
    assert codes is not None
    assert codes.nbytes == BYTES_PER_WEIGHT[qtype] * 8 * 512
    assert codes.nbytes == np.asarray(t.data).nbytes  # the file's own bytes, not one more
    if codes.superblock:  # the super-blocks verbatim: scales and offsets are read inside them
        assert np.array_equal(codes.codes.numpy(), np.asarray(t.data)) and codes.scale is None and codes.minv is None


def test_types_the_kernel_does_not_read_stay_fp32() -> None:
    rng = np.random.default_rng(1)
    f32 = LiteTensor("w", Q.F32, (4, 32), rng.standard_normal((4, 32)).astype(np.float32).view(np.uint8))
    assert block_codes(f32) is None
    _, size = GGML_QUANT_SIZES[Q.Q2_K]
    q2 = LiteTensor("w", Q.Q2_K, (2, 256), rng.integers(0, 256, (2, size), dtype=np.uint8))
    assert block_codes(q2) is None


def assert_within_rounding(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """|got - want| within a few fp32 roundings of the sum of |w x| (what any fp32 matmul's order
    of additions may cost; F.linear on the same weights lands there too)."""
    err = (got.double() - want).abs()
    bound = 32 * torch.finfo(torch.float32).eps * magnitude
    assert bool((err <= bound).all()), f"worst error {float((err / bound).max()):.2f}x the bound"


needs_kernel = pytest.mark.skipif(rowops.load() is None, reason=f"no C kernel: {rowops.status()}")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_the_kernel_multiplies_as_f_linear_on_the_dequantized_weights(threads: int, m: int) -> None:
    # q|k|v-like segments of three types side by side, with and without offsets and two block sizes.
    ws = [block_codes(random_tensor(Q.Q5_0, 40, 768, 2)), block_codes(random_tensor(Q.Q4_K, 13, 768, 3)),
          block_codes(random_tensor(Q.Q6_K, 9, 768, 4))]
    assert all(w is not None for w in ws)
    op = block_dot(ws, threads)  # type: ignore[arg-type]
    assert op is not None
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(5))
    got = op(x)
    w64 = torch.cat([w.weight() for w in ws]).double()  # type: ignore[union-attr]
    want = x.double() @ w64.T
    assert got.shape == (m, 62)
    assert_within_rounding(got, want, x.double().abs() @ w64.abs().T)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", packed_types(), ids=lambda q: q.name)
def test_every_type_through_the_kernel_as_f_linear(qtype: Q, threads: int) -> None:
    # 288 inputs: nine blocks of 32 (an odd tail for the two-accumulator loop; Q6_K: 18 of 16), a
    # K type's super-block is 256 so those get 512; 3 rows; packed and one int8 a weight alike.
    n_in = 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 288
    t = random_tensor(qtype, 11, n_in, 8)
    x = torch.randn(3, n_in, generator=torch.Generator().manual_seed(9))
    for packed in (True, False):
        w = block_codes(t, packed=packed)
        assert w is not None
        op = block_dot([w], threads)
        assert op is not None, f"{qtype.name} packed={packed}: the kernel refused it"
        w64 = w.weight().double()
        assert_within_rounding(op(x), x.double() @ w64.T, x.double().abs() @ w64.abs().T)


PORTABLE = """
import sys
import torch
from kvviz.fast import rowops
rowops.FLAG_SETS = rowops.FLAG_SETS[1:]  # the flags of a compiler without -march=native, before any load()
sys.path.insert(0, {tests!r})
from test_gguf_codes import random_tensor
from kvviz.engine.loading.gguf_codes import block_codes, packed_types
from kvviz.fast.blockdot import block_dot
assert rowops.load() is not None, rowops.status()
worst = 0.0
for qtype in packed_types():
    w = block_codes(random_tensor(qtype, 9, 512, 10))
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(11))
    w64 = w.weight().double()
    err = (block_dot([w], 2)(x).double() - x.double() @ w64.T).abs() / (x.double().abs() @ w64.abs().T)
    worst = max(worst, float(err.max()))
print(rowops.load().kv_dot_simd(), worst)
"""


@needs_kernel
def test_the_portable_build_without_avx2_unpacks_every_type(tmp_path: Path) -> None:
    """Built without -march=native, blockdot.c takes its plain-C loops (the packed codes unpacked
    one by one): the same products, within the same rounding bound as the AVX2 build."""
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "KVVIZ_CACHE_DIR": str(tmp_path)}
    # the timeout is a hang detector, not a speed: a cold build of the C files at load 20 took minutes
    p = subprocess.run([sys.executable, "-c", PORTABLE.format(tests=str(Path(__file__).parent))], env=env,
                       capture_output=True, text=True, timeout=900, cwd=root)
    assert p.returncode == 0, p.stderr
    simd, worst = p.stdout.split()
    assert simd == "0" and float(worst) <= 32 * torch.finfo(torch.float32).eps, worst


@needs_kernel
def test_the_kernel_takes_an_odd_number_of_blocks_and_refuses_what_it_cannot_read() -> None:
    w = block_codes(random_tensor(Q.Q8_0, 7, 96, 6))  # three blocks of 32: the odd tail
    assert w is not None
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(7))
    w64 = w.weight().double()
    assert_within_rounding(block_dot([w], 1)(x), x.double() @ w64.T, x.double().abs() @ w64.abs().T)  # type: ignore[misc]
    bad = BlockCodes(w.codes, w.scale, None, 24)  # a block size the kernel has no loop for
    assert block_dot([bad], 1) is None
    assert block_dot([w, block_codes(random_tensor(Q.Q8_0, 7, 64, 6))], 1) is None  # widths differ
