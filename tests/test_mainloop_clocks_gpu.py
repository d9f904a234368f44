"""The clock hook on the GPU: a ``MainloopCycles`` probe appended to a fused epilogue
changes none of its outputs and reads, per tile, no fewer cycles than the tensor cores
need for the tile; a map pass (no mainloop) reads 0."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from coda import Epilogue, TileLoad, TileStore  # noqa: E402
from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.probes import MainloopCycles  # noqa: E402
from coda.testing.strategies import make_inputs  # noqa: E402

bf16 = torch.bfloat16
#: dense 16-bit WGMMA FLOP per cycle per SM on sm_90
FLOP_PER_CYCLE = 4096


def _cuda_inputs(epi, m, n, k):
    A, B, t = make_inputs(epi, m, n, k, bf16, seed=0)
    t = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in t.items()}
    return A.cuda(), B.cuda(), t


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "swiglu_bwd", "lse_target"])
def test_probe_leaves_outputs_alone_and_reads_at_least_the_tensor_time(name):
    m, n, k = 4096, 2048, 1024
    epi = EPILOGUES[name]
    A, B, t = _cuda_inputs(epi, m, n, k)
    cfg = choose_epilogue_config(m, n, k)
    plain = epi(A, B, config=cfg, **t)
    timed = epi.add(MainloopCycles("cycles"))(A, B, config=cfg, **t)
    torch.cuda.synchronize()
    assert set(timed) == set(plain) | {"cycles"}
    for key, v in plain.items():
        assert torch.equal(v, timed[key]), key
    tile_m = cfg.warpgroup_config.tile_m
    cycles = timed["cycles"]
    ideal = 2 * tile_m * cfg.tile_n * k / FLOP_PER_CYCLE
    assert cycles.shape == (m,)
    assert (cycles >= 0.95 * ideal).all(), (cycles.min().item(), ideal)
    assert (cycles < 1e8).all()
    # the rows of one tile read one mainloop (its 4 warps reach the turn at slightly
    # different times: less than a tile's tensor time apart)
    per_tile = cycles.view(m // tile_m, tile_m)
    assert (per_tile.amax(1) - per_tile.amin(1) < ideal).all()


def test_map_pass_reads_zero_cycles():
    epi = Epilogue().add(TileLoad("x", bf16), TileStore("x", bf16, name="y"))
    epi = epi.add(MainloopCycles("cycles"))
    m, n, k = 1024, 512, 64
    A, B, t = _cuda_inputs(epi, m, n, k)
    out = epi(A, B, **t)
    torch.cuda.synchronize()
    assert torch.equal(out["y"], t["x"])
    assert not out["cycles"].any()
