"""GEMM kernel configurations for the sm90 PingPong mainloop, and the heuristic that picks one.

Sits under ``coda.mainloop``: a :class:`GemmConfig` is a frozen value (it is part of every
compile-cache key), validated at construction so an impossible tile never reaches the
compiler. :func:`choose_config` maps a problem shape to a config; :func:`plan_smem`
turns a config plus dtypes into the shared-memory plan (A/B stages, epilogue stages).
"""

from __future__ import annotations

import functools
import numbers

import attrs

#: L2 evict-first priority of a TMA copy: the 64-bit cache-policy operand of PTX
#: ``.L2::cache_hint`` (the encoding of CUTLASS's ``CacheHintSm90::EVICT_FIRST``).
L2_EVICT_FIRST = 0x12F0000000000000
#: Hint of the epilogue's M x N loads and stores (None: no hint). They stream through L2
#: once, while the mainloop re-reads every A / B tile from L2 for each tile of its row or
#: column of tiles. Measured on an H100 (M = 16384, N = K = 2048, base and hinted code
#: alternated twice): SwiGLU backward (256 MB of M x N traffic) 1.137 / 1.138 -> 1.127 /
#: 1.122 of the plain GEMM, the other epilogues and the plain GEMM unchanged; marking A / B
#: evict-last as well gained nothing more on the plain GEMMs of a Llama block.
EPILOGUE_L2_HINT: int | None = L2_EVICT_FIRST

#: Shared memory per CTA on sm_90 (227 KiB usable with the opt-in carve-out).
SMEM_CAPACITY_SM90 = 232448
#: Bytes reserved for mbarriers and alignment padding.
SMEM_RESERVED = 2048
#: H100/H200 SXM multiprocessor count; used when compiling without a GPU.
DEFAULT_NUM_SMS = 132

#: 256: the cooperative schedule (``GemmConfig.cooperative``): both consumer warpgroups
#: work on one 256-row tile, 128 rows each, then run the epilogue on their halves at once.
_TILE_M = (128, 256)
# PingPong gives each consumer warpgroup a whole tile, so the fp32 accumulator of a
# 128 x tile_n tile lives in one warpgroup's registers: tile_n <= 192 keeps it below
# the 240-register setmaxnreg budget with room for the epilogue. tile_n is a multiple
# of the 32-column epilogue subtile (16-column subtiles measured ~15x slower on the
# H200 and are not offered).
_TILE_N = (64, 96, 128, 160, 192)
_CLUSTERS = ((1, 1), (2, 1), (1, 2), (2, 2))
#: Largest split-K factor a config may ask for.
MAX_SPLIT_K = 8
#: Split-K only when every split keeps at least this many k-tiles (K >= 1024 per split).
MIN_SPLIT_K_TILES = 16
#: Estimated cost of one work unit's epilogue (an fp32 reduce-add tile store), in k-tiles
#: of its mainloop: the price split-K pays per extra unit.
SPLIT_EPILOGUE_K_TILES = 4


def _check_in(allowed):
    def check(instance, attribute, value):
        if value not in allowed:
            raise ValueError(f"GemmConfig.{attribute.name}={value!r}: must be one of {allowed}")

    return check


#: GemmConfig's integer fields
_INT_FIELDS = (
    "tile_m", "tile_n", "tile_k", "cluster_m", "cluster_n", "epi_m", "epi_n", "group_m",
    "epi_stages", "load_stages", "split_k",
)  # fmt: skip


def _is_bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise TypeError(f"GemmConfig.{attribute.name} must be a bool; got {value!r}")


@attrs.frozen(cache_hash=True)
class GemmConfig:
    """One compile-time configuration of the PingPong GEMM.

    tile_m x tile_n is the output tile one consumer warpgroup owns (PingPong: the two
    warpgroups take turns on the tensor cores, one tile each); ``tile_m=256`` is the
    cooperative schedule instead: one CTA tile of 256 rows, both warpgroups on it at
    once, 128 rows each (one B tile per 256 rows instead of per 128: fewer operand bytes
    per FLOP, which at the power limit is clock). Every epilogue runs there, each
    warpgroup on its 128-row half at once with the other's (``partials_tile``), but
    not hidden behind the other warpgroup's mainloop: the fused heuristics keep
    PingPong tiles, and ``config="gemm"`` takes the plain GEMM's for light epilogues on
    long mainloops. tile_k is the K depth of one pipeline stage;
    cluster_m x cluster_n CTAs form a cluster (B is multicast to the CTAs that share an
    N tile, A to those that share an M tile; 2x2 multicasts both, and is opt-in: the
    heuristics never pick it); epi_m x epi_n is the epilogue subtile the visitor sees;
    group_m is the tile-scheduler swizzle: clusters are visited in column-major groups
    of ``group_m`` cluster-rows for L2 reuse.
    """

    tile_m: int = attrs.field(default=128, validator=_check_in(_TILE_M))
    tile_n: int = attrs.field(default=192, validator=_check_in(_TILE_N))
    tile_k: int = attrs.field(default=64, validator=_check_in((64,)))
    cluster_m: int = 2
    cluster_n: int = 1
    epi_m: int = attrs.field(default=64, validator=_check_in((64,)))
    epi_n: int = attrs.field(default=32, validator=_check_in((32, 64)))
    group_m: int = attrs.field(default=8)
    epi_stages: int = attrs.field(default=4)
    #: buffers of the epilogue's M x N operand loads (subtiles in flight per loaded tensor)
    load_stages: int = attrs.field(default=4)
    #: split-K: each output tile's K loop runs as this many units of work whose results
    #: add in global memory (TMA reduce-add); > 1 only for a plain accumulating store
    split_k: int = attrs.field(default=1)
    #: the two consumer warpgroups run their epilogues at the same time, each on its own
    #: half of the store buffers (and of the visitor's scratch), instead of taking turns.
    #: For problems of one k-tile (map passes: the epilogue is the whole kernel), where
    #: there is no mainloop to hide an epilogue behind and taking turns leaves one warp
    #: per scheduler to run it; needs epi_stages >= 2. The load ring is then two tiles'
    #: subtiles deep whatever ``load_stages`` says; a kernel whose buffers do not fit so
    #: takes turns instead (``PingPongGemm.concurrent``)
    concurrent_epilogues: bool = attrs.field(default=False, validator=_is_bool)
    #: the epilogue's 32-bit register <-> shared copies (fp32 values, packed width-2
    #: 16-bit pairs) take their two column halves in an order staggered by lane parity
    #: (``coda.mainloop.epilogue_io``): by the bank model 2 shared-memory wavefronts per
    #: 64-bit access instead of the 4 Nsight Compute measured. Opt-in: compiled and
    #: checked on the CPU (SASS, the copy's data movement run on the host), not yet run
    #: on a GPU
    staggered_copies: bool = attrs.field(default=False, validator=_is_bool)
    #: the epilogue runs each 64-row band's subtiles in a runtime loop over one copy of
    #: the subtile code instead of unrolled, one copy per subtile: a kernel a fraction of
    #: the size (the tensor cores of the other warpgroup slow down beside a long
    #: unrolled epilogue: docs/fused-epilogues.md). Needs a ``rollable`` visitor
    rolled_epilogue: bool = attrs.field(default=False, validator=_is_bool)

    def __attrs_post_init__(self) -> None:
        for name in _INT_FIELDS:  # (128.0 == 128: a float would pass the checks below)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"GemmConfig.{name} must be an int; got {value!r}")
        if (self.cluster_m, self.cluster_n) not in _CLUSTERS:
            raise ValueError(
                f"GemmConfig cluster ({self.cluster_m}, {self.cluster_n}) "
                f"must be one of {_CLUSTERS}"
            )
        if self.tile_n % self.epi_n:
            raise ValueError(
                f"GemmConfig tile_n={self.tile_n} must be a multiple of epi_n={self.epi_n}"
            )
        if self.group_m < 1:
            raise ValueError("group_m must be >= 1")
        if not 1 <= self.epi_stages <= 8:
            raise ValueError("epi_stages must be in [1, 8]")
        if not 1 <= self.load_stages <= 16:
            raise ValueError("load_stages must be in [1, 16]")
        if self.concurrent_epilogues and self.epi_stages < 2:
            raise ValueError("concurrent_epilogues needs epi_stages >= 2 (one per warpgroup)")
        if not 1 <= self.split_k <= MAX_SPLIT_K:
            raise ValueError(f"split_k must be in [1, {MAX_SPLIT_K}]; got {self.split_k}")
        if self.cooperative and self.split_k > 1:
            raise ValueError("tile_m=256 (cooperative) does not split K")

    @property
    def cooperative(self) -> bool:
        """Both consumer warpgroups on one 256-row tile (see the class doc)."""
        return self.tile_m == 256

    @property
    def warpgroup_config(self) -> GemmConfig:
        """The config of the 128-row tile one consumer warpgroup computes and stores:
        this one, or for a cooperative tile its half (with concurrent epilogues: the
        warpgroups store their halves at once)."""
        if not self.cooperative:
            return self
        return attrs.evolve(self, tile_m=128, concurrent_epilogues=True)

    @property
    def partials_tile(self) -> tuple[int, int]:
        """(rows, columns) of the tile an epilogue's per-tile partials (``TileReduce``,
        log-sum-exp, ...) are taken over: one warpgroup's, i.e. a cooperative tile's
        128-row half."""
        return (self.warpgroup_config.tile_m, self.tile_n)

    @property
    def tile_shape_mnk(self) -> tuple[int, int, int]:
        return (self.tile_m, self.tile_n, self.tile_k)

    @property
    def cluster_shape_mnk(self) -> tuple[int, int, int]:
        return (self.cluster_m, self.cluster_n, 1)

    @property
    def epi_tile(self) -> tuple[int, int]:
        return (self.epi_m, self.epi_n)

    @property
    def subtiles_per_tile(self) -> tuple[int, int]:
        return (self.tile_m // self.epi_m, self.tile_n // self.epi_n)


@attrs.frozen
class SmemPlan:
    """How a config spends shared memory: A/B ring stages and epilogue buffers."""

    ab_stages: int
    ab_bytes_per_stage: int
    epi_bytes: int
    visitor_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.ab_stages * self.ab_bytes_per_stage + self.epi_bytes + self.visitor_bytes


def plan_smem(
    config: GemmConfig,
    ab_bytes_per_elem: int,
    epi_bytes_per_stage: int,
    visitor_bytes: int = 0,
    capacity: int = SMEM_CAPACITY_SM90,
) -> SmemPlan:
    """Fit as many A/B stages as shared memory allows after the epilogue's buffers.

    ``epi_bytes_per_stage`` is what one epilogue subtile stage needs (all stored outputs
    together); ``visitor_bytes`` is any extra a visitor requests (loaded operands, etc.).
    """
    ab = (config.tile_m + config.tile_n) * config.tile_k * ab_bytes_per_elem
    epi = epi_bytes_per_stage * config.epi_stages
    free = capacity - SMEM_RESERVED - epi - visitor_bytes
    stages = free // ab
    if stages < 2:
        raise ValueError(
            f"config {config} leaves room for {stages} A/B stage(s) after "
            f"{epi + visitor_bytes} epilogue bytes; at least 2 are needed"
        )
    return SmemPlan(min(stages, 8), ab, epi, visitor_bytes)


#: Relative throughput of a full wave of 128 x tile_n tiles (128 x 192 reads less shared
#: memory per FLOP); measured on an H200 (plain 128 x 128 vs 128 x 192 GEMMs at M=16384).
_TILE_EFFICIENCY = {192: 1.0, 128: 0.98}

#: Problems of at least this many FLOPs run long enough to sit at the card's power limit,
#: where 128-wide tiles (17% more operand bytes per MAC through L2 and shared memory than
#: 128 x 192) lose clock: on an H200 the LM head's backward GEMMs (K or N = 128256) ran
#: 2-23% faster with 128 x 192 tiles at 8.6-17 TFLOP, 3-9% slower at 4.3 TFLOP
#: (``benchmarks/results/vocab_gemm_configs_h200.json``, ``..._tiles_h200.json``).
#: Above it 128 x 128 tiles are costed at ``_LONG_RUN_EFFICIENCY_128``.
LONG_RUN_FLOPS = 6e12
_LONG_RUN_EFFICIENCY_128 = 0.9


def long_running(m: int, n: int, k: int) -> bool:
    """Whether an (m, n, k) GEMM has ``LONG_RUN_FLOPS`` or more: long enough to sit at the
    card's power limit."""
    return 2.0 * m * n * k >= LONG_RUN_FLOPS


#: Relative throughput of cooperative 256-row tiles on long-running problems (one B tile
#: per 256 rows: fewer operand bytes per FLOP still). Fitted on an H200
#: (``benchmarks/results/vocab_gemm_configs_coop_h200.json``: the LM head's dh / dW
#: GEMMs of 8.6-34 TFLOP, 256 x 192 up to 16% faster than 128 x 192, 256 x 128 best
#: where 192-wide tiles leave a last wave a third empty); not offered below
#: ``LONG_RUN_FLOPS``, where they measured even (4.3 TFLOP).
_LONG_RUN_EFFICIENCY_COOPERATIVE = {192: 1.1, 128: 1.02}


#: Cooperative (tile_m, tile_n) offered on long-K problems below ``LONG_RUN_FLOPS`` (K >=
#: ``_LONG_K_COOPERATIVE_MIN_K``, e.g. a Llama block's weight gradients, K = tokens, and its
#: down projection),
#: in a 1 x 2 cluster (A multicast to the two CTAs of neighbouring N tiles), costed at
#: ``_LONG_K_COOPERATIVE_EFFICIENCY`` (PingPong 128 x 192: 1.0). What it is for: a training
#: step keeps the card at its power limit, where a GEMM's time follows its energy, and
#: PingPong 128 x 128 tiles in 2 x 1 clusters read up to 3x cuBLAS's DRAM bytes on these
#: shapes (``benchmarks/gemm_counters.py``, Nsight Compute) and ran at SM clocks a median
#: 6-8% below cuBLAS's at the same ~690 W. Run back to back for 0.4 s each (``gemm_configs.py
#: --seconds``, H200, 2026-11-28), the shapes this picks ran 3.7-6.6% faster than the
#: 128 x 128 PingPong tile and -0.1..+2.6% against 128 x 192; in short bursts
#: (``gemm.py``'s protocol) within -3..+5% of the previous pick
#: (``benchmarks/results/gemm_configs_sustained_coop_h200.json``, ``..._burst_...``).
#: From K = 8192 (a batch of 8192 tokens' weight gradients) since 2026-11-28; before, from
#: ``LONG_K`` = 10240:
#: on the 13 shapes with K = 8192 of the Llama blocks at 8192 and 16384 tokens the pick
#: changes on 11, each faster run back to back (+0.1..+6.4%; +0.6..+6.4% where it
#: replaces 128 x 128) and -5.8..+2.4% in short bursts
#: (``benchmarks/results/gemm_configs_sustained_k8192_h200.json``, ``..._burst_...``).
#: Up to ``_LONG_K_COOPERATIVE_MAX_K``: the range measured (K = 8192-28672); the LM
#: head's vocabulary-long K (128256) keeps the picks fitted on it (split-K, 128 x 128).
_LONG_K_COOPERATIVE = (256, 128)
_LONG_K_COOPERATIVE_EFFICIENCY = 1.01
_LONG_K_COOPERATIVE_MIN_K = 8192
_LONG_K_COOPERATIVE_MAX_K = 32768


#: On cards with less DRAM bandwidth than an H200 (``short_groups``), PingPong GEMMs with
#: K >= LONG_K and N <= LONG_K_MAX_N walk the tiles in swizzle groups of LONG_K_GROUP_M
#: cluster rows instead of the default 8. Measured on an H100 (``benchmarks/gemm_raster.py``,
#: two interleaved runs): the long-K GEMMs of a Llama 3 8B block (K = 11008-22016, N = 4096
#: / 11008) ran 15-27% faster at 1 than at 8 (0.52-0.88x -> 0.65-0.93x cuBLAS); at
#: K <= 6144 the two were within noise; the wide 16384 x 22016 x 4096 GEMM ran 12% slower
#: at 1 (hence the N bound). The H200 runs these GEMMs at 1.04-1.11x cuBLAS with 8.
LONG_K = 10240
LONG_K_MAX_N = 11008
LONG_K_GROUP_M = 1


def choose_config(
    m: int,
    n: int,
    k: int,
    num_sms: int = DEFAULT_NUM_SMS,
    split_ok: bool = False,
    short_groups: bool = False,
) -> GemmConfig:
    """Heuristic config for an (m, n, k) problem with 16-bit inputs.

    A 2x1 cluster whenever there are two tile rows (B multicast halves its L2 traffic).
    The tile width minimizes the wave-quantized time: the persistent grid runs
    ``num_sms / 2`` clusters, so a problem takes ceil(cluster tiles / clusters) waves of
    tiles costing tile_n / efficiency each. 128 x 192 wins on large problems; 128 x 128
    when 192-wide tiles would leave a last wave mostly empty (e.g. the weight-gradient
    GEMMs of a Llama block, whose M x N is small and K = tokens long), except on problems
    of ``LONG_RUN_FLOPS`` or more, which run power-limited and favour 128 x 192 more.

    From ``LONG_RUN_FLOPS`` on, cooperative 256-row tiles are candidates too (a unit of
    work is then a 256-row tile, costing twice a 128-row one's k-tiles, at
    ``_LONG_RUN_EFFICIENCY_COOPERATIVE``).

    Long-K problems (8192 <= K <= 32768) below ``LONG_RUN_FLOPS`` also get the cooperative
    256 x 128 tile in a 1 x 2 cluster as a candidate, at ``_LONG_K_COOPERATIVE_EFFICIENCY``
    (``_LONG_K_COOPERATIVE``): less DRAM and L2 traffic per FLOP, so a higher clock at the
    power limit a training step keeps the card at.

    ``short_groups`` (the card's DRAM bandwidth is below an H200's, e.g. an H100: see
    :func:`coda.runtime.checks.short_swizzle_groups`): long-K problems take swizzle groups
    of ``LONG_K_GROUP_M`` cluster rows (``LONG_K``) instead (the cooperative long-K
    candidate was measured on the H200 only).

    ``split_ok`` (the caller stores into an fp32 output it zeroed or accumulates into):
    split-K is also considered, a unit of work costing its share of the k-tiles plus
    ``SPLIT_EPILOGUE_K_TILES`` for its reduce-add store, with every split keeping at
    least ``MIN_SPLIT_K_TILES`` k-tiles; ties keep fewer splits.
    """
    tiles_m = -(-m // 128)
    k_tiles = max(1, -(-k // 64))
    cluster_m = 2 if tiles_m >= 2 else 1
    long_run = long_running(m, n, k)
    efficiency = dict(_TILE_EFFICIENCY)
    if long_run:
        efficiency[128] = _LONG_RUN_EFFICIENCY_128
    max_split = min(MAX_SPLIT_K, k_tiles // MIN_SPLIT_K_TILES) if split_ok else 1

    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    def cost(choice: tuple[int, int, int, int, int, float]) -> float:
        """Wave-quantized time: waves of clusters x k-tiles per unit x tile area / eff."""
        tile_m, tile_n, splits, cm, cn, eff = choice
        units = ceil(ceil(m, tile_m), cm) * ceil(ceil(n, tile_n), cn) * splits
        per_unit = ceil(k_tiles, splits) + (SPLIT_EPILOGUE_K_TILES if splits > 1 else 0)
        waves = ceil(units, max(1, num_sms // (cm * cn)))
        return waves * per_unit * tile_n * (tile_m // 128) / eff

    # list order breaks ties: PingPong 192 first, then fewer splits, then cooperative
    choices = [
        (128, t, s, cluster_m, 1, efficiency[t])
        for s in range(1, max(1, max_split) + 1)
        for t in _TILE_EFFICIENCY
    ]
    if long_run and tiles_m >= 2:
        coop = _LONG_RUN_EFFICIENCY_COOPERATIVE
        choices += [(256, t, 1, cluster_m, 1, e) for t, e in coop.items()]
    elif (
        _LONG_K_COOPERATIVE_MIN_K <= k <= _LONG_K_COOPERATIVE_MAX_K
        and not short_groups
        and tiles_m >= 2
        and n > _LONG_K_COOPERATIVE[1]
    ):
        choices.append((*_LONG_K_COOPERATIVE, 1, 1, 2, _LONG_K_COOPERATIVE_EFFICIENCY))
    tile_m, tile_n, splits, cm, cn, _ = min(choices, key=cost)
    cfg = GemmConfig(tile_m=tile_m, tile_n=tile_n, cluster_m=cm, cluster_n=cn, split_k=splits)
    if short_groups and tile_m == 128 and k >= LONG_K and n <= LONG_K_MAX_N:
        cfg = attrs.evolve(cfg, group_m=LONG_K_GROUP_M)
    return cfg


#: K up to which a fused GEMM is one k-tile: its epilogue is nearly the whole kernel
ONE_K_TILE = 64
#: Epilogue subtile width of one-k-tile problems (map passes). Their epilogue is the whole
#: kernel, and a 64 x 64 subtile halves the subtiles, and so the warpgroup barriers and
#: the TMA issue rounds, per tile. Measured on an H200 (``benchmarks/map_pass.py``,
#: 8192 x 8192 bf16, 2026-11-26): the loss's gradient map 2.83 -> 3.10 TB/s, the RMSNorm
#: backward map 3.00 -> 3.19, a copy 2.95 -> 3.23 (torch's copy: 4.07). Behind a
#: mainloop the wider subtile was not faster (docs/fused-epilogues.md), so GEMMs keep 32.
MAP_EPI_N = 64


#: Largest K at which a fused epilogue takes the plain GEMM's 128 x 192 PingPong tile where
#: :func:`choose_config` picks one (0: never). On short mainloops the wider tile's 17%
#: fewer operand bytes per FLOP outweigh its register squeeze: at M = 16384, K = 2048 on
#: an H200 (``benchmarks/epilogue_tiles.py``, rotated rounds, 2026-11-29) every catalogue
#: epilogue ran 2.6-5.8% faster at N = 3072 (whose plain GEMM also runs 128 x 192),
#: 0.4-5.5% at N = 8192, and at N = 16384 all but two (residual store +2.0%, column sums
#: +1.0%) 0.1-6.3%; at K = 4096 (N = 14336, 28672) mixed, 0.960-1.031 of 128 x 128
#: (``results/epilogue_tiles_192_k4096_h200.json``), at K = 8192 neutral, and at
#: N = K = 2048, where the plain pick is 128 x 128, slower: there the fused tile stays
#: 128 x 128 as well.
WIDE_EPILOGUE_MAX_K = 2048


def choose_epilogue_config(m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS) -> GemmConfig:
    """Config for a GEMM with a fused epilogue: 128x128 tiles, or the plain GEMM's 128x192
    on short mainloops (:data:`WIDE_EPILOGUE_MAX_K`).

    A 128x192 tile keeps 192 fp32 accumulator registers per thread of the 240 a consumer
    warpgroup has, leaving few for epilogue values, reductions and running states (many
    epilogues spill: ``coda.runtime.epilogue_kernels.epilogue_choice`` then narrows the
    tile); 128x128 leaves about 100. On long-running problems where it does not spill,
    fused ones gained nothing from 128x192 (H200, 16384 x 44032 x 8192, 11.8 TFLOP:
    SwiGLU / RMSNorm forward, residual store, row scale within -0.8% / +0.4% of 128x128
    in interleaved rounds), so there the tile stays 128 wide.

    A problem of one k-tile (``k <= ONE_K_TILE``: the map passes) has no mainloop to hide
    its epilogue behind: both warpgroups run their epilogues at once
    (``concurrent_epilogues``), with 4 store buffers each, a load ring two tiles deep and
    ``MAP_EPI_N``-column subtiles.
    """
    cluster_m, one_k_tile, tile_n = epilogue_size_class(m, n, k, num_sms)
    if one_k_tile:
        return GemmConfig(
            tile_n=128,
            cluster_m=cluster_m,
            epi_n=MAP_EPI_N,
            epi_stages=8,
            concurrent_epilogues=True,
        )
    return GemmConfig(tile_n=tile_n, cluster_m=cluster_m)


def epilogue_size_class(
    m: int, n: int, k: int, num_sms: int = DEFAULT_NUM_SMS
) -> tuple[int, bool, int]:
    """What of (m, n, k) ``choose_epilogue_config`` depends on: (cluster rows, one
    k-tile, tile width). Calls in the same class share a launch plan."""
    one_k_tile = k <= ONE_K_TILE
    wide = not one_k_tile and k <= WIDE_EPILOGUE_MAX_K and _plain_is_128x192(m, n, k, num_sms)
    return (2 if m > 128 else 1, one_k_tile, 192 if wide else 128)


@functools.lru_cache(maxsize=4096)
def _plain_is_128x192(m: int, n: int, k: int, num_sms: int) -> bool:
    """Whether :func:`choose_config` gives (m, n, k) a 128 x 192 PingPong tile (cached:
    every fused call whose signature the call cache has not seen asks, e.g. each new
    sequence length)."""
    plain = choose_config(m, n, k, num_sms)
    return (plain.tile_m, plain.tile_n, plain.split_k) == (128, 192, 1)
