"""CPU CI for rolled epilogues (``GemmConfig.rolled_epilogue``): each 64-row band's
subtiles run in a runtime loop over one copy of the subtile code. Every catalogue
epilogue compiles rolled for sm_90a with HGMMA, no local memory and a smaller kernel
than unrolled; the primitives' band hooks keep row state across the loop; a primitive
that needs a static subtile index is refused up front."""

from __future__ import annotations

import attrs
import pytest
import torch

from coda import Epilogue
from coda.mainloop.config import GemmConfig
from coda.primitives import Elementwise, LogSumExp, TileReduce, TileStore
from coda.primitives.base import Primitive
from coda.runtime import gemm_kernels
from coda.runtime.fused import FusedVisitor, not_rollable
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts
from coda.specs import ValueSpec
from coda.testing.catalog import EPILOGUES

UNROLLED = GemmConfig(tile_n=128, cluster_m=2)
ROLLED = attrs.evolve(UNROLLED, rolled_epilogue=True)


@attrs.frozen
class StaticOnly(Primitive):
    """An elementwise copy that never declared ``rollable`` (the default: False)."""

    out: str
    of: str

    reads = property(lambda self: (self.of,))
    writes = property(lambda self: (self.out,))

    def infer(self, values):
        src = values[self.of]
        return (ValueSpec(self.out, src.kind, src.width),)

    def reference(self, env):
        env.values[self.out] = env.values[self.of]

    def visit(self, sub, state):
        sub.values[self.out] = sub.values[self.of]

    def trace(self, ctx, values, state):
        values[self.out] = values[self.of]


def test_builtins_are_rollable_and_a_user_primitive_is_not_by_default():
    for name, epi in EPILOGUES.items():
        assert not_rollable(epi) == [], name
        assert FusedVisitor(epi).rollable
    epi = Epilogue().add(StaticOnly("y", "acc")).add(TileStore("y", torch.bfloat16))
    assert not_rollable(epi) == ["StaticOnly('y')"]
    assert not FusedVisitor(epi).rollable


def test_rolled_config_is_a_validated_bool_and_part_of_the_key():
    with pytest.raises(TypeError, match="rolled_epilogue must be a bool"):
        GemmConfig(rolled_epilogue=1)
    assert ROLLED != UNROLLED and hash(ROLLED) != hash(UNROLLED)
    # a cooperative tile's warpgroups keep it
    assert GemmConfig(tile_m=256, rolled_epilogue=True).warpgroup_config.rolled_epilogue


def test_kernel_refuses_a_rolled_config_for_a_static_only_primitive():
    from coda.mainloop.kernel import PingPongGemm

    epi = Epilogue().add(StaticOnly("y", "acc")).add(TileStore("y", torch.bfloat16))
    with pytest.raises(ValueError, match="rolled_epilogue"):
        PingPongGemm(ROLLED, torch.bfloat16, FusedVisitor(epi))
    PingPongGemm(UNROLLED, torch.bfloat16, FusedVisitor(epi))  # unrolled: fine


def _sass_counts(epi, config, tmp_path):
    key = gemm_kernels.GemmKernelKey(config, torch.bfloat16, FusedVisitor(epi))
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    return opcode_counts(disassemble(cubin))


@pytest.mark.compile
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_rolled_catalogue_kernels_are_smaller_and_spill_free(name, tmp_path):
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = EPILOGUES[name]
    rolled = _sass_counts(epi, ROLLED, tmp_path / "rolled")
    unrolled = _sass_counts(epi, UNROLLED, tmp_path / "unrolled")
    assert count_prefix(rolled, "HGMMA") > 0
    assert count_prefix(rolled, "LDL") == 0 and count_prefix(rolled, "STL") == 0, "spills"
    stores = sum(1 for p in epi.primitives if type(p).__name__ == "TileStore")
    assert (count_prefix(rolled, "UTMASTG") > 0) == (stores > 0)
    # one copy of the subtile code instead of four per band (the switch that picks the
    # subtile's accumulator registers and the loop cost a little)
    assert sum(rolled.values()) < 0.85 * sum(unrolled.values()), (
        sum(rolled.values()),
        sum(unrolled.values()),
    )


@pytest.mark.compile
def test_rolled_row_state_of_several_reductions_compiles(tmp_path):
    """Three row states of different kinds (a sum, a max, the online log-sum-exp's pair)
    live in registers across the runtime loop, next to a column reduction and a store."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = (
        Epilogue()
        .add(Elementwise("y", lambda a: a * 0.5, ins=("acc",)))
        .add(TileStore("y", torch.bfloat16))
        .add(TileReduce("s", of="y", op="sum"))
        .add(TileReduce("mx", of="acc", op="max"))
        .add(TileReduce("cs", of="y", op="sum", per="col"))
        .add(LogSumExp("lse", of="acc"))
    )
    ops = _sass_counts(epi, ROLLED, tmp_path)
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0
