"""What a session measures once and keeps: the model timed for the pages' defaults (``estimator``,
``measure.sizing``) and this machine's roofline (``machine_probe``, ``measure.probe``)."""
from __future__ import annotations

import dataclasses
from typing import Any

import streamlit as st

from kvviz import LoadedModel
from kvviz.measure import threads
from kvviz.measure.cpu_load import load_average
from kvviz.measure.measuring import try_lock
from kvviz.measure.probe import probe_machine
from kvviz.measure.sizing import Estimator, calibrate, contention
from kvviz.measure.stats import MachineProbe
from kvviz.ui.state import session


def estimator(model: LoadedModel, fast: bool = True) -> Estimator | None:
    """This model timed on this machine (``measure.sizing.calibrate``), once per session and engine;
    None while another session holds the measurement lock (the page keeps its smallest defaults)."""
    cals: dict[Any, Any] = session.setdefault(session.SIZING_CALIBRATION, {})
    key = (model.name, str(model.device), model.dtype_name, bool(fast))
    if key not in cals:
        lock = try_lock(2.0)
        if lock is None:
            return None
        try:
            with st.spinner("Timing this model once, to size the defaults to this machine (a second or two)…"):
                cal = calibrate(model, fast)
            # What the timing was slowed by: the load average right after it (it counts this run too).
            cals[key] = dataclasses.replace(cal, contention=_contention_now()[0])
        finally:
            lock.release()
    # Scaled by how much busier the machine is now than it was then (measure/sizing.py).
    now, others = _contention_now()
    return Estimator(cals[key], model.config, now, others)


def _contention_now() -> tuple[float, float | None]:
    """(``sizing.contention`` now, the load average it comes from, which the busy note names too)."""
    load = load_average()
    return contention(load, threads.ensure().cores), load


def machine_probe(model: LoadedModel, again: bool = False) -> MachineProbe:
    """Peak FLOP/s and bandwidth of this device in the model's dtype, measured once per session
    (``again`` measures anew, e.g. once a competing job has finished)."""
    probes: dict[Any, MachineProbe] = session.setdefault(session.MACHINE_PROBES, {})
    key = (str(model.device), model.dtype_name)
    if again or key not in probes:
        with st.spinner("Measuring this machine's peak matmul FLOP/s and memory bandwidth (a second or two)…"):
            probes[key] = probe_machine(model.device, model.dtype)
    return probes[key]
