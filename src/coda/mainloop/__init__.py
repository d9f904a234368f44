"""The fixed sm90a PingPong GEMM mainloop: configs, tile scheduler, visitor hooks, kernel.

Importing this package does not import CuTeDSL; :mod:`coda.mainloop.kernel` and
:mod:`coda.mainloop.scheduler` do (through :mod:`coda.runtime.cute_env` users).
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
