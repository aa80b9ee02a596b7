"""The C row ops (kvviz.fast.rowops): each fused call against the PyTorch ops it replaces, in float64."""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvviz.fast import rowops

ROOT = Path(__file__).resolve().parents[2]
needs_c = pytest.mark.skipif(rowops.load() is None, reason=f"no C row ops here: {rowops.status()}")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ln: tuple | None, gelu: bool,
               res: torch.Tensor | None) -> torch.Tensor:
    """The same layer in float64 PyTorch ops: act(LN(x) @ w + b) + res."""
    x, w = x.double(), w.double()
    if ln is not None:
        lw, lb, eps = ln
        x = F.layer_norm(x, (x.shape[0],), lw.double(), None if lb is None else lb.double(), eps)
    y = x @ w
    if b is not None:
        y = y + b.double()
    if gelu:
        y = F.gelu(y, approximate="tanh")
    return y if res is None else res.double() + y


@needs_c
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("n_in,n_out", [(256, 768), (1024, 256), (32, 96), (100, 37), (64, 300), (7, 129),
                                        (33, 2304), (20, 1025), (13, 1500)])
@pytest.mark.parametrize("ln,gelu,res,bias", [
    (False, False, False, True),  # plain: c_proj without its residual (the bench floor)
    (True, False, False, True),  # LN1 + c_attn
    (False, False, True, True),  # c_proj / MLP projection + residual
    (True, True, False, True),  # LN2 + c_fc + GELU
    (True, False, False, False),  # ln_f + the bias-free LM head
])
def test_row_linear_matches_float64(threads: int, n_in: int, n_out: int, ln: bool, gelu: bool, res: bool,
                                    bias: bool) -> None:
    """Every fusion, widths that are not multiples of the 128-column tile (a short last tile,
    fewer tiles than threads), thread counts that do not divide the tiles, and outputs wider
    than 1,024 columns (the row-blocked order, with row counts that 8 does not divide)."""
    g = torch.Generator().manual_seed(n_in * 1000 + n_out)
    x = torch.randn(n_in, generator=g)
    w = torch.randn(n_in, n_out, generator=g) / n_in ** 0.5
    b = torch.randn(n_out, generator=g) if bias else None
    lnp = (1 + 0.2 * torch.randn(n_in, generator=g), 0.2 * torch.randn(n_in, generator=g), 1e-5) if ln else None
    r = torch.randn(n_out, generator=g) if res else None
    op = rowops.row_linear(w, b, threads, ln=lnp, gelu=gelu)
    assert op is not None and op.threads == threads
    got = op(x, r)
    assert got.shape == (n_out,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _reference(x, w, b, lnp, gelu, r), atol=1e-5, rtol=1e-5)


@needs_c
def test_layer_norm_without_bias_and_odd_eps() -> None:
    """bias=False models pass no LayerNorm bias (a NULL pointer on the C side)."""
    g = torch.Generator().manual_seed(1)
    x, w, lw = 3 + 5 * torch.randn(48, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    op = rowops.row_linear(w, None, 2, ln=(lw, None, 1e-3))
    assert op is not None
    torch.testing.assert_close(op(x).double(), _reference(x, w, None, (lw, None, 1e-3), False, None),
                               atol=1e-5, rtol=1e-5)


@needs_c
def test_reads_the_weights_in_place() -> None:
    """No copy of the weights: an in-place change shows in the next call."""
    w, b, x = torch.randn(16, 160), torch.zeros(160), torch.randn(16)
    op = rowops.row_linear(w, b, 2)
    assert op is not None
    before = op(x)
    w.mul_(2)
    b.add_(1)
    torch.testing.assert_close(op(x), 2 * before + 1, atol=1e-5, rtol=1e-5)


@needs_c
def test_what_does_not_fit_gets_none() -> None:
    """The C side takes contiguous fp32 CPU tensors of matching sizes only; the caller falls back."""
    w, b = torch.randn(32, 64), torch.randn(64)
    assert rowops.row_linear(w.double(), None, 2) is None
    assert rowops.row_linear(w.bfloat16(), None, 2) is None
    assert rowops.row_linear(w.t(), None, 2) is None  # not contiguous
    assert rowops.row_linear(w, torch.randn(63), 2) is None  # bias of the wrong size
    assert rowops.row_linear(w, b, 2, ln=(torch.randn(31), None, 1e-5)) is None  # LN of the wrong size
    assert rowops.row_linear(torch.randn(64), None, 2) is None  # not a matrix
    wide = rowops.max_ln_width() + 1
    assert rowops.row_linear(torch.randn(wide, 16), None, 2, ln=(torch.ones(wide), None, 1e-5)) is None
    assert rowops.row_linear(torch.randn(wide, 16), None, 2) is not None  # no LayerNorm: any width


@needs_c
def test_one_openmp_runtime_is_loaded() -> None:
    """Built after torch, the library binds to the OpenMP runtime torch loaded: one thread pool."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    gomps = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
    assert len(gomps) <= 1, gomps


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    # A hang detector, not a speed: the process may build the library (each flag set up to the build's own
    # BUILD_TIMEOUT_S), and a cold -O3 build at load 20 on 2 cores took about two minutes (issue 36).
    from kvviz.fast.rowops import BUILD_TIMEOUT_S, FLAG_SETS

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=BUILD_TIMEOUT_S * len(FLAG_SETS) + 300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


GENERATE = ("import kvviz\nfrom kvviz.fast import rowops\n"
            "m = kvviz.load_model('random:tiny', device='cpu')\n"
            "r = kvviz.generate(m, [1, 2, 3], max_new_tokens=5)\n"
            "print(rowops.load() is None, m.fast.plan().rows is None, len(r.generated_ids))\n"
            "print(rowops.status())\n")


@pytest.mark.parametrize("env,why", [
    ({"KVVIZ_ROWOPS": "0"}, "off (KVVIZ_ROWOPS=0)"),
    ({"CC": "/nonexistent/cc"}, "did not run"),
    ({"CC": "/bin/false"}, "failed"),
])
def test_without_the_library_generation_falls_back_and_says_why(tmp_path: Path, env: dict[str, str],
                                                                 why: str) -> None:
    p = _run(GENERATE, KVVIZ_CACHE_DIR=str(tmp_path), **env)
    assert p.returncode == 0, p.stderr
    first, status = p.stdout.splitlines()[:2]
    assert first == "True True 5"
    assert why in status
    assert not list(tmp_path.iterdir())  # a failed build leaves no temporary file behind


def test_an_unusable_build_folder_gets_one_clear_reason(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    p = _run(GENERATE, KVVIZ_CACHE_DIR=str(blocker / "kvviz"))
    assert p.returncode == 0, p.stderr
    first, status = p.stdout.splitlines()[:2]
    assert first == "True True 5"
    assert status.startswith(f"cannot create the build folder {blocker / 'kvviz'}") and "KVVIZ_CACHE_DIR" in status


@needs_c
def test_a_build_is_made_once_reused_and_rebuilt_when_damaged_or_tampered(tmp_path: Path) -> None:
    """One build folder's life (each build compiles the C sources, seconds apiece, so one test walks
    it): a fresh folder gets one build and nothing else; a second process reuses it; a file that is
    not a library is rebuilt; a library with one byte changed (still a loadable ELF, not the one
    built) is caught by its recorded sha256 and rebuilt; the folder is private (0700)."""
    cache = tmp_path / "cache"  # created by the build, private
    code = "from kvviz.fast import rowops\nprint(rowops.load() is not None, rowops.status())"
    first = _run(code, KVVIZ_CACHE_DIR=str(cache))
    assert first.returncode == 0 and first.stdout.startswith("True built with"), first.stdout + first.stderr
    built = sorted(cache.glob("rowops-*.so"))
    # No temporary file left behind: the library and its recorded sha256 only.
    assert len(built) == 1 and set(cache.iterdir()) == {built[0], built[0].with_suffix(".sha256")}
    (lib,) = built
    digest = lib.with_suffix(".sha256").read_text().strip()
    assert digest == hashlib.sha256(lib.read_bytes()).hexdigest()
    mtime = lib.stat().st_mtime_ns
    second = _run(code, KVVIZ_CACHE_DIR=str(cache))
    assert second.stdout == first.stdout and lib.stat().st_mtime_ns == mtime  # reused, not rebuilt

    lib.write_bytes(b"not a shared library")
    third = _run(code, KVVIZ_CACHE_DIR=str(cache))
    assert third.stdout == first.stdout, third.stdout + third.stderr
    assert lib.stat().st_size > 1000 and set(cache.iterdir()) == {lib, lib.with_suffix(".sha256")}

    data = bytearray(lib.read_bytes())
    data[-1] ^= 0xFF
    lib.write_bytes(bytes(data))
    fourth = _run(code, KVVIZ_CACHE_DIR=str(cache))
    assert fourth.stdout == first.stdout, fourth.stdout + fourth.stderr
    assert lib.read_bytes() != bytes(data)
    assert hashlib.sha256(lib.read_bytes()).hexdigest() == lib.with_suffix(".sha256").read_text().strip()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


# --- rowdot.c: nn.Linear's (out, in) layout, fp32 or bf16 weights (the Llama family) ---------------

def _dot_reference(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor | None], norm: tuple | None,
                   swiglu: bool, res: torch.Tensor | None, rope: tuple | None, pos: torch.Tensor | None) -> torch.Tensor:
    """The same call in float64 PyTorch ops, from the weights as stored (bf16 widened exactly)."""
    x = x.double()
    if norm is not None:
        w, eps = norm
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    outs = [x @ w.double().t() + (0 if b is None else b.double()) for w, b in zip(ws, bs)]
    y = F.silu(outs[0]) * outs[1] if swiglu else torch.cat(outs, dim=-1)
    if rope is not None:
        cos, sin, dims = rope
        hs = cos.shape[1]
        c = cos.double()[pos.repeat(x.shape[0] // pos.numel())]  # (m, hs): row i at pos[i % len(pos)]
        s = sin.double()[pos.repeat(x.shape[0] // pos.numel())]
        heads = y[:, :dims].reshape(x.shape[0], -1, hs)
        x1, x2 = heads.chunk(2, dim=-1)
        rot = heads * c[:, None] + torch.cat((-x2, x1), dim=-1) * s[:, None]
        y = torch.cat([rot.reshape(x.shape[0], dims), y[:, dims:]], dim=-1)
    return y if res is None else res.double() + y


def _dot_case(g: torch.Generator, n_in: int, outs: list[int], m: int, dtype: torch.dtype, bias: bool):
    x = torch.randn(m, n_in, generator=g)
    ws = [(torch.randn(n, n_in, generator=g) / n_in ** 0.5).to(dtype) for n in outs]
    bs = [torch.randn(n, generator=g) if bias else None for n in outs]
    return x, ws, bs


@needs_c
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_in,outs", [(576, [576, 192, 192]), (64, [64]), (37, [13, 5, 9]), (100, [7]),
                                       (24, [1030])])
@pytest.mark.parametrize("m", [1, 3])
def test_row_dot_matches_float64(threads: int, dtype: torch.dtype, n_in: int, outs: list[int], m: int) -> None:
    """Side-by-side segments (q, k, v) with RMSNorm and bias, then a residual: widths that are not
    multiples of the 4 rows of a dot or of the 16 floats of its inner loop, more threads than
    rows of 4, a few input rows at once, and bf16 weights widened exactly."""
    g = torch.Generator().manual_seed(n_in * 7 + sum(outs) + m)
    x, ws, bs = _dot_case(g, n_in, outs, m, dtype, bias=True)
    norm = (1 + 0.2 * torch.randn(n_in, generator=g), 1e-5)
    op = rowops.row_dot(ws, bs, threads, norm=norm)
    assert op is not None and op.n_out == sum(outs) and op.threads == threads
    got = op(x)
    assert got.shape == (m, sum(outs)) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _dot_reference(x, ws, bs, norm, False, None, None, None),
                               atol=1e-5, rtol=1e-5)
    plain = rowops.row_dot(ws[:1], None, threads)  # no norm, no bias, plus the residual
    r = torch.randn(m, outs[0], generator=g)
    torch.testing.assert_close(plain(x, r).double(), _dot_reference(x, ws[:1], [None], None, False, r, None, None),
                               atol=1e-5, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_in,hidden,m", [(576, 1536, 1), (48, 23, 2), (40, 8, 5)])
def test_row_dot_swiglu_matches_float64(threads: int, dtype: torch.dtype, n_in: int, hidden: int, m: int) -> None:
    """gate and up read in one pass: silu(RMSNorm(x) Wg^T + bg) * (RMSNorm(x) Wu^T + bu), an odd
    hidden width included (the last gate/up pair of a dot alone)."""
    g = torch.Generator().manual_seed(n_in + hidden + m)
    x, ws, bs = _dot_case(g, n_in, [hidden, hidden], m, dtype, bias=m > 1)
    x = 3 * x  # gates well into silu's tails
    norm = (1 + 0.2 * torch.randn(n_in, generator=g), 1e-6)
    op = rowops.row_dot(ws, bs, threads, norm=norm, swiglu=True)
    assert op is not None and op.n_out == hidden
    torch.testing.assert_close(op(x).double(), _dot_reference(x, ws, bs, norm, True, None, None, None),
                               atol=1e-5, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m,pos", [(1, [37]), (4, [0, 1, 2, 3]), (6, [5, 9, 11])])
def test_row_dot_rope_rotates_q_and_k_heads_at_each_rows_position(threads: int, m: int, pos: list[int]) -> None:
    """RoPE on the first rope_dims outputs (q's and k's heads), v left alone; row i at
    pos[i % len(pos)], as a batch of prefill rows (b, t) meets positions t."""
    from kvviz.engine.models.llama import LlamaConfig, rope_tables

    hs, nh, nkv, n_in = 16, 4, 2, 64
    cos, sin = rope_tables(LlamaConfig(vocab_size=8, block_size=64, n_layer=1, n_head=nh, n_kv_head=nkv,
                                       n_embd=n_in, head_dim=hs, intermediate_size=8, rope_theta=1000.0))
    g = torch.Generator().manual_seed(m)
    x, ws, bs = _dot_case(g, n_in, [nh * hs, nkv * hs, nkv * hs], m, torch.float32, bias=True)
    dims = (nh + nkv) * hs
    op = rowops.row_dot(ws, bs, threads, rope=(cos, sin, dims))
    assert op is not None
    p = torch.tensor(pos)
    torch.testing.assert_close(op(x, pos=p).double(),
                               _dot_reference(x, ws, bs, None, False, None, (cos, sin, dims), p), atol=1e-5, rtol=1e-5)


@needs_c
def test_row_dot_refuses_what_does_not_fit() -> None:
    w = torch.randn(32, 16)
    assert rowops.row_dot([w.double()], None, 2) is None
    assert rowops.row_dot([w.half()], None, 2) is None
    assert rowops.row_dot([w, w.bfloat16()], None, 2) is None  # mixed weight dtypes
    assert rowops.row_dot([w.t()], None, 2) is None  # not contiguous
    assert rowops.row_dot([w, torch.randn(8, 15)], None, 2) is None  # different input widths
    assert rowops.row_dot([w], [torch.randn(31)], 2) is None  # bias of the wrong size
    assert rowops.row_dot([w], [torch.randn(32).bfloat16()], 2) is None  # biases are fp32
    assert rowops.row_dot([w], None, 2, norm=(torch.ones(15), 1e-5)) is None
    assert rowops.row_dot([w, torch.randn(8, 16)], None, 2, swiglu=True) is None  # gate and up differ
    assert rowops.row_dot([w] * 4, None, 2) is None  # more segments than the C side holds
    cos = torch.ones(8, 16)
    assert rowops.row_dot([w], None, 2, rope=(cos, cos, 48)) is None  # rotates more than it outputs
    assert rowops.row_dot([w], None, 2, rope=(cos, cos, 24)) is None  # not whole heads
    assert rowops.row_dot([w], None, 2, rope=(cos, cos, 32)) is not None


PORTABLE = """
import torch
from kvviz.fast import rowops
rowops.FLAG_SETS = rowops.FLAG_SETS[1:]  # the flags of a compiler without -march=native
lib = rowops.load()
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 37, generator=g)
err = 0.0
for dt in (torch.float32, torch.bfloat16):
    ws = [torch.randn(n, 37, generator=g).to(dt) for n in (13, 13)]
    for swiglu in (False, True):
        got = rowops.row_dot(ws, None, 2, swiglu=swiglu)(x).double()
        outs = [x.double() @ w.double().t() for w in ws]
        want = torch.nn.functional.silu(outs[0]) * outs[1] if swiglu else torch.cat(outs, 1)
        err = max(err, float((got - want).abs().max()))
print(lib.kv_dot_simd(), err < 1e-4, err)
"""


@needs_c
def test_the_portable_build_without_avx2_agrees(tmp_path: Path) -> None:
    """Built without -march=native (no AVX2 intrinsics), rowdot.c takes its plain-C loops."""
    p = _run(PORTABLE, KVVIZ_CACHE_DIR=str(tmp_path))
    assert p.returncode == 0, p.stderr
    simd, ok, err = p.stdout.split()
    assert (simd, ok) == ("0", "True"), err
