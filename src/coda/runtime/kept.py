"""Tensors that coda keeps between calls, allocated where no private memory pool takes them.

Sits in ``coda.runtime``; used by its per-stream scratch (``epilogue_kernels``) and by
``coda.fusions``' cached zero operands of map passes. A tensor held in a module-level cache
must come from the caching allocator's ordinary pool. Two things route a thread's or a
stream's allocations into a private pool: CUDA graph capture (there the callers take a
fresh, uncached tensor instead) and ``torch.compile(mode="reduce-overhead")``'s CUDA graph
trees while they warm a graph up, which is not a capture: nothing tells the caller. A
cached tensor born in that warm-up lives in the tree's pool, which the tree checks
("tensor(s) in the cudagraph pool not tracked as outputs") and recycles as its own. So a
kept CUDA tensor is made by a helper thread on a side stream of its device (allocations of
neither are routed), and the caller's current stream waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["kept"]

#: device index -> the side stream kept tensors are made on
_side_streams: dict[int, torch.cuda.Stream] = {}


def kept(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()``, for a cache: on CUDA run by a helper thread on a side stream of
    ``device`` (outside any pool that routes the calling thread's or stream's
    allocations), ready on the current stream when it returns. Elsewhere ``make()``.
    A miss path: it starts a thread."""
    if device.type != "cuda":
        return make()
    index = torch.cuda.current_device() if device.index is None else device.index
    side = _side_streams.get(index)
    if side is None:
        side = _side_streams[index] = torch.cuda.Stream(device=index)
    box: dict[str, object] = {}

    def work() -> None:
        try:
            with torch.cuda.device(index), torch.cuda.stream(side):
                box["tensor"] = make()
                done = torch.cuda.Event()
                done.record(side)
                box["done"] = done
        except BaseException as error:  # re-raised on the calling thread
            box["error"] = error

    helper = threading.Thread(target=work, name="coda-kept-alloc")
    helper.start()
    helper.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    tensor: torch.Tensor = box["tensor"]  # type: ignore[assignment]
    current = torch.cuda.current_stream(index)
    current.wait_event(box["done"])  # type: ignore[arg-type]
    tensor.record_stream(current)
    return tensor
