"""Block codes (engine/loading/gguf_codes.py) and the block kernel (fast/blockdot.py).

The codes must rebuild every weight exactly as gguf's own dequantizer gives it, for every type the
kernel reads; the kernel must multiply them as F.linear multiplies those fp32 weights (allclose:
only the order of the additions differs). Types whose blocks are random bytes cover every bit of
the unpacking; the fp16 scale fields are set to finite values so the comparison is of numbers.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
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
    assert codes.codes.dtype == torch.int8 and codes.block == (16 if qtype == Q.Q6_K else 32)
    assert (codes.minv is None) == (qtype in (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q6_K))


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
def test_the_kernel_takes_an_odd_number_of_blocks_and_refuses_what_it_cannot_read() -> None:
    w = block_codes(random_tensor(Q.Q8_0, 7, 96, 6))  # three blocks of 32: the odd tail
    assert w is not None
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(7))
    w64 = w.weight().double()
    assert_within_rounding(block_dot([w], 1)(x), x.double() @ w64.T, x.double().abs() @ w64.abs().T)  # type: ignore[misc]
    bad = BlockCodes(w.codes, w.scale, None, 24)  # a block size the kernel has no loop for
    assert block_dot([bad], 1) is None
    assert block_dot([w, block_codes(random_tensor(Q.Q8_0, 7, 64, 6))], 1) is None  # widths differ
