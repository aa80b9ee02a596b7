"""The calculator's human-readable report (what the CLI prints without --json)."""
from __future__ import annotations

from kvviz.memory.spec import MemoryResult
from kvviz.units import fmt_bytes


def _both(n: int | None) -> str:
    return fmt_bytes(n, both_units=True)  # '1.07 GB (1.00 GiB)': readers mix GB and GiB


def summary_text(res: MemoryResult) -> str:
    """The report: shape, settings, each figure in both units, the fit, the formula, notes and warnings."""
    s, r = res.spec, res.request
    lines = [
        f"{s.name}: {s.attention}, {s.n_layers} layers, {s.n_heads} heads"
        + ("" if s.mla else f", {s.n_kv_heads} KV heads") + f", head_dim {s.head_dim}",
        f"context {r.seq_len:,} x batch {r.batch:,} x beams {r.beams}, KV {r.kv_dtype}, weights {r.weight_dtype}",
        f"KV per token:  {_both(res.kv_bytes_per_token)}",
        f"KV total:      {_both(res.kv_bytes)}",
    ]
    if r.paged:
        lines.append(f"paging waste:  {_both(res.paging_waste_bytes)} (block {r.block_size})")
    lines.append(f"weights:       {_both(res.weights_bytes)} ({res.params_source})")
    lines.append(f"total:         {_both(res.total_bytes)}")
    if res.fit is not None:
        f = res.fit
        mt = "unbounded (every layer windowed)" if f.max_seq_len is None else f"{f.max_seq_len:,}"
        lines.append(f"GPU {r.gpu_gib:g} GiB, {r.reserve:.0%} reserved: {'fits' if f.fits else 'does NOT fit'}; "
                     f"max batch at this context {f.max_batch:,}; max context at this batch {mt}")
    lines.append("formula:")
    lines += [f"  {ln}" for ln in res.formula]
    lines += [f"note: {n}" for n in s.notes]
    lines += [f"warning: {w}" for w in res.warnings]
    return "\n".join(lines)
