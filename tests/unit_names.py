"""The unit scanner tests/project/test_units.py holds the code and docs to, shared with the page
tests that check a figure on screen (tests/ui/test_app_perf.py): binary KiB/MiB/GiB, a decimal
unit only after the binary one in the same string."""
from __future__ import annotations

import re

DECIMAL = re.compile(r"(?<![\w/])(KB|MB|GB|TB)(?![\w/])")  # 'GB/s' and 'MB/s' are rates, allowed
BINARY = re.compile(r"\b(KiB|MiB|GiB|TiB)\b")


def decimal_without_binary(text: str) -> list[str]:
    """Decimal units that no binary unit precedes in the same string ('1.00 GiB (1.07 GB)' passes)."""
    bad = []
    for m in DECIMAL.finditer(text):
        if not BINARY.search(text, 0, m.start()):
            bad.append(text[max(0, m.start() - 40):m.end() + 10])
    return bad
