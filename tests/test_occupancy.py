"""coda.runtime.occupancy.grid_sms, the persistent grid's SMs per cluster size, with the
driver's probe stood in (CPU): clusters that fit, one-CTA clusters unasked, a failed probe
falling back to the whole device without being remembered. (On the H200 the probe itself:
tests/test_mainloop_gpu.py::test_grid_holds_only_the_clusters_that_fit.)"""

from __future__ import annotations

import pytest
import torch

from coda.runtime import occupancy


@pytest.fixture
def device(monkeypatch):
    dev = torch.device("cuda", 7)  # never touched: hopper_device and the probe stood in
    monkeypatch.setattr(occupancy.checks, "hopper_device", lambda d: 132)
    yield dev
    for size in (1, 2, 4):
        occupancy._grid_sms.pop((dev, size), None)


def test_clusters_that_fit_set_the_grid(device, monkeypatch):
    asked = []

    def probe(d, size):
        asked.append(size)
        return {2: 66, 4: 30}[size]

    monkeypatch.setattr(occupancy, "_clusters_that_fit", probe)
    assert occupancy.grid_sms(device, 1) == 132
    assert occupancy.grid_sms(device, 2) == 132
    assert occupancy.grid_sms(device, 4) == 120
    assert occupancy.grid_sms(device, 4) == 120  # remembered: asked once
    assert asked == [2, 4]


def test_a_failed_probe_keeps_the_whole_device_and_asks_again(device, monkeypatch):
    def refuse(d, size):
        raise RuntimeError("refused")

    monkeypatch.setattr(occupancy, "_clusters_that_fit", refuse)
    assert occupancy.grid_sms(device, 4) == 132
    assert (device, 4) not in occupancy._grid_sms
    monkeypatch.setattr(occupancy, "_clusters_that_fit", lambda d, size: 30)
    assert occupancy.grid_sms(device, 4) == 120
