"""coda.runtime.kept on CPU: off CUDA it is the factory itself; on CUDA (torch.cuda's
stream API replaced by recording fakes) the factory runs on a helper thread inside a side
stream of the device, its errors re-raise in the caller, and the caller's current stream
waits for the result and records it. tests/test_cuda_graphs_gpu.py checks on the GPU that
such tensors stay out of a memory pool the calling thread's allocations are routed to."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from coda.runtime import kept as kept_module
from coda.runtime.kept import kept


def test_off_cuda_it_is_the_factory():
    made = torch.arange(3.0)
    assert kept(lambda: made, torch.device("cpu")) is made


class FakeStream:
    def __init__(self, device=None):
        self.device = device
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class FakeEvent:
    def __init__(self):
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream


class Recorded(torch.Tensor):
    """A CPU tensor that remembers the streams it was recorded on."""

    def record_stream(self, stream):  # noqa: D102
        self.__dict__.setdefault("streams", []).append(stream)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream API as fakes that record where things ran."""
    seen: dict = {"current": FakeStream(), "inside": []}

    @contextlib.contextmanager
    def stream(s):
        seen["inside"].append((threading.current_thread().name, s))
        yield

    monkeypatch.setattr(kept_module, "_side_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: seen["current"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return seen


def test_on_cuda_a_helper_thread_makes_it_on_a_side_stream(fake_cuda):
    threads = []

    def make():
        threads.append(threading.current_thread().name)
        return torch.zeros(4).as_subclass(Recorded)

    got = kept(make, torch.device("cuda", 1))
    side = kept_module._side_streams[1]
    assert threads == ["coda-kept-alloc"]  # not the caller's thread
    assert fake_cuda["inside"] == [("coda-kept-alloc", side)]  # on the side stream
    (event,) = fake_cuda["current"].waited  # the caller's stream waits for it
    assert event.recorded_on is side
    assert got.__dict__["streams"] == [fake_cuda["current"]]
    # one side stream per device, reused; the device index defaults to the current one
    kept(lambda: torch.zeros(1).as_subclass(Recorded), torch.device("cuda", 1))
    kept(lambda: torch.zeros(1).as_subclass(Recorded), torch.device("cuda"))
    assert kept_module._side_streams[1] is side and set(kept_module._side_streams) == {0, 1}


def test_on_cuda_the_factorys_error_reaches_the_caller(fake_cuda):
    def make():
        raise RuntimeError("CUDA out of memory (simulated)")

    with pytest.raises(RuntimeError, match="out of memory"):
        kept(make, torch.device("cuda", 0))
    assert fake_cuda["current"].waited == []
