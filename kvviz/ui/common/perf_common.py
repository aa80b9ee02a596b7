"""Kept only for ui/pages/serving/serving_page.py, whose import another branch owns this round: the
names it imports, from the modules that now hold them (issue 38 split this file by job). New code
imports from those modules; once serving_page.py does, this file goes."""
from __future__ import annotations

from kvviz.ui.common.busy_notes import acquire_or_warn, busy_note
from kvviz.ui.common.measuring_page import page_model, where

__all__ = ["acquire_or_warn", "busy_note", "page_model", "where"]
