"""Block codes (engine/loading/gguf_codes.py) and the block kernel (fast/blockdot.py).

The codes must rebuild every weight exactly as gguf's own dequantizer gives it, for every type the
kernel reads, packed (issue 42) or one int8 a weight. The kernel rounds its input rows to int16 per
block of 32 (csrc/lblocks.c) and multiplies the codes by them in integers: for every type it must
equal a float64 reference computed here from the rounded rows by that spec (to fp32 accumulation),
and the exact product on the unrounded rows within the rounding's derived bound; with AVX2 and in
its portable C. Types whose blocks are random bytes cover every bit of the unpacking; the fp16
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

from gguf_writers import BITS, BYTES_PER_WEIGHT  # noqa: E402
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


U = 2.0 ** -24  # fp32's unit roundoff


def round_rows(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's rounding of fp32 rows (m, n), by lblocks.c's spec, computed independently:
    (q (m, n) integers as float64, dx (m, ceil(n / 32)) fp32). dx = max|x_b| / 32767 in fp32 (0 for
    an all-zero block); q = round-half-even(x / dx), the quotient in double (exact enough that this
    rounds the true quotient; ties are exact)."""
    x32 = x.float().numpy()
    m, n = x32.shape
    nq = -(-n // 32)
    xb = np.zeros((m, nq * 32), np.float32)
    xb[:, :n] = x32
    xb = xb.reshape(m, nq, 32)
    dx = (np.abs(xb).max(-1) / np.float32(32767)).astype(np.float32)  # fp32 division, as the kernel's
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(xb.astype(np.float64) / dx.astype(np.float64)[..., None])
    q[dx == 0] = 0.0
    return np.clip(q, -32767, 32767).reshape(m, nq * 32)[:, :n], dx


def kernel_reference(w: BlockCodes, x: torch.Tensor) -> tuple[np.ndarray, ...]:
    """For m fp32 rows x: (ref, tol, exact, bound), each (m, out) float64.

    ref: the kernel's maths in float64, sum_b s_b dx_b sum_{i in b} c_i q_i - sum_b m_b sum_{i in b} x_i
    (the codes times the rounded rows; the offsets times the unrounded ones' sums). tol: what fp32
    can cost it. Each scale term s_b dx_b S_b (S_b an exact int32 sum) passes through at most one
    rounding of s_b * dx_b (s_b itself exact: an fp16, or d times a small integer), one of S_b (or a
    lane's part of it) to fp32, at most nb accumulating FMAs (the AVX2 lanes take half), the two
    accumulators' sum and three of the horizontal sum; each offset term through the block sum of at
    most 32 x's (31 additions), one product, at most nb additions and the final subtraction. So
    |kernel - ref| <= gamma_k sum |terms| with k = nb + 40 and gamma_k = k u / (1 - k u), which is
    under 1.001 k u for every k here (k <= 100).
    exact: x @ W^T in float64 on the unrounded x, W = s c - m (gguf's fp32 weights are these,
    rounded once). bound: |kernel - exact| <= tol + sum_b (dx_b / 2) sum_{i in b} |s_b c_i|, since
    ref - exact = sum_i s_b c_i (q_i dx_b - x_i) and |q dx - x| <= dx / 2 (exact rounding of the
    true quotient; q*dx is exact in float64: 15 bits times 24). The offsets multiply the unrounded
    sums, so the codes' part s_b c_i = w_i + m_b, not w_i, is what the rounding multiplies."""
    out, n = w.shape
    q, dx = round_rows(x)
    s, mn = w.scales()
    sc = w.unpacked().double() * s.double().repeat_interleave(w.block, dim=1)  # (out, n): s_b c_i, exact
    dxw = dx.astype(np.float64)[:, np.arange(n) // 32]  # (m, n): each input's step
    xhat, x64, scn = q * dxw, x.double().numpy(), sc.numpy()
    ref, mag = xhat @ scn.T, np.abs(xhat) @ np.abs(scn).T
    exact = x64 @ scn.T
    if mn is not None:
        mw = mn.double().repeat_interleave(w.block, dim=1).numpy()
        ref, exact, mag = ref - x64 @ mw.T, exact - x64 @ mw.T, mag + np.abs(x64) @ np.abs(mw).T
    tol = 1.001 * (n // w.block + 40) * U * mag
    return ref, tol, exact, tol + (dxw / 2) @ np.abs(scn).T


def assert_as_specified(got: torch.Tensor, w: BlockCodes, x: torch.Tensor, what: str = "") -> None:
    """The kernel's output equals the reference on the rounded rows (to fp32) and the exact product
    within the rounding's bound."""
    ref, tol, exact, bound = kernel_reference(w, x)
    g = got.double().numpy()
    assert np.isfinite(g).all(), what
    err, err_b = np.abs(g - ref), np.abs(g - exact)
    assert (err <= tol).all(), f"{what}: {float((err / np.maximum(tol, 1e-300)).max()):.2f}x the fp32 bound"
    assert (err_b <= bound).all(), f"{what}: {float((err_b / np.maximum(bound, 1e-300)).max()):.2f}x the bound"


def probe_rows(m: int, n_in: int, seed: int) -> torch.Tensor:
    """m rows that exercise the rounding: Gaussian; a zero block; one value of hundreds in each
    block among values a hundred thousand times smaller (Gemma 3's residuals reach hundreds: the small
    ones round to nothing); hundreds; 1e-20."""
    g = torch.Generator().manual_seed(seed)
    kinds = []
    for i in range(m):
        r = torch.randn(n_in, generator=g)
        k = i % 5
        if k == 1:
            r[32:64] = 0.0
        elif k == 2:
            r = r * 1e-3
            r[::32] = 500.0 * torch.sign(torch.randn(n_in // 32 + (n_in % 32 > 0), generator=g))
        elif k == 3:
            r = r * 300.0
        elif k == 4:
            r = r * 1e-20
        kinds.append(r)
    return torch.stack(kinds)


needs_kernel = pytest.mark.skipif(rowops.load() is None, reason=f"no C kernel: {rowops.status()}")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_the_kernel_multiplies_side_by_side_segments_as_specified(threads: int, m: int) -> None:
    # q|k|v-like segments of three types side by side, with and without offsets and two block sizes.
    ws = [block_codes(random_tensor(Q.Q5_1, 40, 768, 2)), block_codes(random_tensor(Q.Q4_K, 13, 768, 3)),
          block_codes(random_tensor(Q.Q6_K, 9, 768, 4))]
    assert all(w is not None for w in ws)
    op = block_dot(ws, threads)  # type: ignore[arg-type]
    assert op is not None
    x = probe_rows(m, 768, 5)
    got = op(x)
    assert got.shape == (m, 62)
    at = 0
    for w in ws:
        assert_as_specified(got[:, at:at + w.shape[0]], w, x, f"segment at {at}")  # type: ignore[arg-type,union-attr]
        at += w.shape[0]  # type: ignore[union-attr]


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qtype", packed_types(), ids=lambda q: q.name)
def test_every_type_through_the_kernel_as_specified(qtype: Q, threads: int) -> None:
    # 288 inputs: nine blocks of 32 (an odd tail for the two-accumulator loop; Q6_K: 18 of 16), a
    # K type's super-block is 256 so those get 512; 1 to 8 rows; packed and one int8 a weight alike.
    n_in = 512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 288
    t = random_tensor(qtype, 11, n_in, 8)
    for packed in (True, False):
        w = block_codes(t, packed=packed)
        assert w is not None
        op = block_dot([w], threads)
        assert op is not None, f"{qtype.name} packed={packed}: the kernel refused it"
        for m in range(1, 9):
            x = probe_rows(m, n_in, 9 + m)
            assert_as_specified(op(x), w, x, f"{qtype.name} packed={packed} m={m}")


@needs_kernel
@pytest.mark.parametrize("block", [32, 16])
def test_the_rounding_is_exactly_the_specified_one(block: int) -> None:
    """Codes of 1 and a scale of 1, one row whose largest value is 32767 / 1024, so dx = 2^-10 exactly
    and every product and sum is exact in fp32: the output must be dx * sum(q) to the last bit, with
    q rounded half to even (2.5 -> 2, 3.5 -> 4, -2.5 -> -2), not sum(x). Blocks of 16 (Q6_K's
    layout) share the step of their block of 32."""
    step = 2.0 ** -10
    steps = [32767, 2.5, 3.5, -2.5, 0.3, 1000.7, -0.49, 7.5] + [0.25 * k for k in range(24)]
    x = torch.tensor([steps], dtype=torch.float32) * step
    w = BlockCodes(torch.ones(1, 32, dtype=torch.int8), torch.ones(1, 32 // block, dtype=torch.float16), None, block)
    op = block_dot([w], 1)
    assert op is not None
    q = [32767, 2, 4, -2, 0, 1001, 0, 8] + [round(0.25 * k) for k in range(24)]  # Python's round: half to even
    assert float(op(x)[0, 0]) == sum(q) * step != float(x.double().sum())


@needs_kernel
@pytest.mark.parametrize("glu", ["geglu", "swiglu"])
@pytest.mark.parametrize("m", [1, 5])
def test_the_fused_glu_is_within_its_bound_of_float64(glu: str, m: int) -> None:
    """GeGLU (Gemma) and SwiGLU (Llama) fused after the products, on the kernel's own gate and up (the
    call without the epilogue gives them bit for bit), against float64: gelu_tanh(g) = g / (1 + E),
    E = exp(-2 u), u = sqrt(2 / pi) (g + 0.044715 g^3) (silu: E = exp(-g)). The bound, relative:
    E / (1 + E) * (EPS_EXP + 14 |u| 2^-24) + 3 * 2^-24: exp_poly's own error (the polynomial's 2e-7 and
    its fp32 evaluation: 4e-7) and u's seven fp32 roundings (relative 7 * 2^-24 of u, moving E by
    2 |u| that much), carried into 1 / (1 + E) by E / (1 + E) <= 1 (no cancellation); then 1 + E, the
    division and the product with up. Plus |g up| 1e-38 where the exponent passes exp's clamp at
    +-88, and three roundings at fp32's subnormal spacing 2^-149 (the 1e-20 rows' outputs are 1e-40). 75 outputs: nine lanes of eight and a scalar tail of three."""
    ws = [block_codes(random_tensor(Q.Q5_0, 75, 256, 12)), block_codes(random_tensor(Q.Q5_0, 75, 256, 13))]
    fused = block_dot(ws, 1, geglu=glu == "geglu", swiglu=glu == "swiglu")  # type: ignore[arg-type]
    plain = block_dot(ws, 1)  # type: ignore[arg-type]
    assert fused is not None and plain is not None
    x = probe_rows(m, 256, 14) * (3.0 if m == 1 else 1.0)  # gates from about -80 to 80 (and +-1e4, 1e-19)
    raw = plain(x).double()
    g, up = raw[:, :75], raw[:, 75:]
    u = (2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3) if glu == "geglu" else g / 2
    e = torch.exp(-2 * u)
    want = g / (1 + e) * up
    frac = torch.where(torch.isinf(e), torch.ones_like(e), e / (1 + e))
    bound = frac * (4e-7 + 14 * u.abs() * 2.0 ** -24) + 3 * 2.0 ** -24
    err = (fused(x).double() - want).abs()
    slack = (g * up).abs() * 1e-38 + 3 * 2.0 ** -149
    assert (err <= bound * want.abs() + slack).all(), float(((err - slack) / (want.abs() * bound)).max())
    assert float(g.min()) < -20 and float(g.max()) > 20  # the exponent's both signs, far out


def exp_poly32(v: np.ndarray) -> np.ndarray:
    """rowcommon.h's exp_poly in numpy's fp32 operations, one by one in its order (IEEE, no FMA)."""
    f = np.float32
    v = np.minimum(np.maximum(v, f(-88)), f(88)).astype(f)
    k = np.rint(v * f(1.44269504088896341)).astype(f)
    r = ((v - k * f(0.693359375)) + k * f(2.12194440e-4)).astype(f)
    p = np.full_like(v, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = (p * r + f(c)).astype(f)
    p = (p * r * r + r + f(1)).astype(f)
    return (p * ((k.astype(np.int32) + 127) << 23).view(f)).astype(f)


@needs_kernel
def test_the_fused_swiglu_is_the_scalar_formula_bit_for_bit() -> None:
    """SwiGLU's eight lanes (exp8) and its scalar tail give silu(g) * up = g / (1 + exp_poly(-g)) * up to
    the last bit, as the scalar loop did before the lanes: 75 outputs, nine lanes of eight and three."""
    ws = [block_codes(random_tensor(Q.Q5_0, 75, 256, 12)), block_codes(random_tensor(Q.Q5_0, 75, 256, 13))]
    x = probe_rows(5, 256, 14)
    raw = block_dot(ws, 1)(x).numpy()  # type: ignore[arg-type,misc]
    g, up = raw[:, :75], raw[:, 75:]
    want = ((g / (np.float32(1) + exp_poly32(-g))).astype(np.float32) * up).astype(np.float32)
    got = block_dot(ws, 1, swiglu=True)(x).numpy()  # type: ignore[arg-type,misc]
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


PORTABLE = """
import sys
import torch
from kvviz.fast import rowops
rowops.FLAG_SETS = rowops.FLAG_SETS[1:]  # the flags of a compiler without -march=native, before any load()
sys.path[:0] = [{tests!r}, {helpers!r}]  # this folder and tests/ (gguf_writers)
from test_gguf_codes import assert_as_specified, probe_rows, random_tensor
from kvviz.engine.loading.gguf_codes import block_codes, packed_types
from kvviz.fast.blockdot import block_dot
assert rowops.load() is not None, rowops.status()
for qtype in packed_types():
    for packed in (True, False):
        w = block_codes(random_tensor(qtype, 9, 512, 10), packed=packed)
        for threads in (1, 2):
            x = probe_rows(5, 512, 11 + threads)
            op = block_dot([w], threads)
            assert_as_specified(op(x), w, x, f"{{qtype.name}} packed={{packed}}")
            # five rows in one call: each as the one-row call gives it (test_block_rows.py's AVX2 check)
            assert torch.equal(op(x), torch.cat([op(x[i:i + 1]) for i in range(5)])), qtype.name
from kvviz.fast.logits import argmax_checked  # logits.c's plain loops in the same build
x = torch.randn(3, 1001, generator=torch.Generator().manual_seed(5))
x[1, 700] = x[1, 300] = 50.0
assert argmax_checked(x)[0].tolist() == torch.argmax(x, dim=-1).tolist()
print(rowops.load().kv_dot_simd())
"""


@needs_kernel
def test_the_portable_build_without_avx2_unpacks_every_type(tmp_path: Path) -> None:
    """Built without -march=native, blockdot.c takes its plain-C loops (the packed codes unpacked
    one by one, the same int16 rounding and integer sums): within the same bounds as the AVX2 build,
    and several rows in one call equal to the rows one at a time."""
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "KVVIZ_CACHE_DIR": str(tmp_path)}
    # the timeout is a hang detector, not a speed: a cold build of the C files at load 20 took minutes
    p = subprocess.run([sys.executable, "-c", PORTABLE.format(tests=str(Path(__file__).parent), helpers=str(root / "tests"))], env=env,
                       capture_output=True, text=True, timeout=900, cwd=root)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["0"]


@needs_kernel
def test_the_kernel_takes_an_odd_number_of_blocks_and_refuses_what_it_cannot_read() -> None:
    w = block_codes(random_tensor(Q.Q8_0, 7, 96, 6))  # three blocks of 32: the odd tail
    assert w is not None
    x = probe_rows(3, 96, 7)
    assert_as_specified(block_dot([w], 1)(x), w, x)  # type: ignore[misc]
    bad = BlockCodes(w.codes, w.scale, None, 24)  # a block size the kernel has no loop for
    assert block_dot([bad], 1) is None
    assert block_dot([w, block_codes(random_tensor(Q.Q8_0, 7, 64, 6))], 1) is None  # widths differ
