"""The C row ops (kvviz.fast.rowops): each fused call against the PyTorch ops it replaces, in float64."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvviz.fast import rowops

ROOT = Path(__file__).resolve().parent.parent
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
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


GENERATE = ("import kvviz\nfrom kvviz.fast import rowops\n"
            "m = kvviz.load_model('random:tiny', device='cpu')\n"
            "r = kvviz.generate(m, prompt_ids=[1, 2, 3], max_new_tokens=5)\n"
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
def test_a_damaged_cached_build_is_rebuilt(tmp_path: Path) -> None:
    code = "from kvviz.fast import rowops\nprint(rowops.load() is not None, rowops.status())"
    first = _run(code, KVVIZ_CACHE_DIR=str(tmp_path))
    assert first.stdout.startswith("True built with"), first.stdout + first.stderr
    (built,) = tmp_path.glob("rowops-*.so")
    built.write_bytes(b"not a shared library")
    second = _run(code, KVVIZ_CACHE_DIR=str(tmp_path))
    assert second.stdout == first.stdout, second.stdout + second.stderr
    # The library and the sha256 recorded beside it at build time, nothing else.
    assert built.stat().st_size > 1000 and set(tmp_path.iterdir()) == {built, built.with_suffix(".sha256")}


@needs_c
def test_builds_into_the_cache_dir_once(tmp_path: Path) -> None:
    """A fresh cache folder gets one build; a second process reuses it."""
    code = "from kvviz.fast import rowops\nprint(rowops.load() is not None, rowops.status())"
    first = _run(code, KVVIZ_CACHE_DIR=str(tmp_path))
    assert first.returncode == 0 and first.stdout.startswith("True built with"), first.stdout + first.stderr
    built = sorted(tmp_path.glob("rowops-*.so"))
    # No temporary file left behind: the library and its recorded sha256 only.
    assert len(built) == 1 and set(tmp_path.iterdir()) == {built[0], built[0].with_suffix(".sha256")}
    mtime = built[0].stat().st_mtime_ns
    second = _run(code, KVVIZ_CACHE_DIR=str(tmp_path))
    assert second.stdout == first.stdout and built[0].stat().st_mtime_ns == mtime
