"""The fixed sm90a PingPong GEMM mainloop: configs, tile scheduler, visitor hooks, kernel.

Importing this package does not import CuTeDSL; :mod:`coda.mainloop.kernel` and
:mod:`coda.mainloop.scheduler` do, after :mod:`coda.mainloop.cute_env` has set the
Hopper target. :mod:`coda.mainloop.dtypes` maps torch dtypes to CuTeDSL types. This is
the bottom layer of coda: it imports nothing of coda above it.
"""

from .config import GemmConfig, SmemPlan, choose_config, plan_smem
from .visitor import AccStore, SubtileContext

__all__ = [
    "GemmConfig",
    "SmemPlan",
    "choose_config",
    "plan_smem",
    "AccStore",
    "SubtileContext",
]
