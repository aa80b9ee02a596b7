"""The Live server page's "Runs on" guess: this machine's device, since the page's own walkthrough
(`make vllm`, then serve SmolLM2) puts the server here; a CPU-only machine no longer opens on CUDA,
whose two batches in flight would change a sliding-window layer's figures."""
from __future__ import annotations

import pytest
import torch
from streamlit.testing.v1 import AppTest


def _page() -> None:
    from kvviz.ui.pages.live import live_server

    live_server.page()


@pytest.mark.parametrize("cuda", [False, True])
def test_runs_on_defaults_to_this_machines_device(monkeypatch: pytest.MonkeyPatch, cuda: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    at = AppTest.from_function(_page, default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="live_device").value == ("cuda" if cuda else "cpu")
    at.selectbox(key="live_device").select("cuda" if not cuda else "cpu").run()  # the user's pick stands
    assert at.selectbox(key="live_device").value == ("cuda" if not cuda else "cpu")
