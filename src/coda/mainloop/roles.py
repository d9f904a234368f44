"""Who does what in one CTA of the PingPong kernel: warpgroup sizes, warp roles, the
register split after ``setmaxnreg`` and the named-barrier ids.

Sits beside :mod:`coda.mainloop.kernel` (which launches 3 warpgroups: two consumers and
the producer) and :mod:`coda.mainloop.epilogue_driver` (the consumers' epilogues), which
both read these; nothing here emits code.
"""

THREADS_PER_WG = 128
NUM_CONSUMER_WGS = 2
PRODUCER_WARP = NUM_CONSUMER_WGS * 4  # first warp of warpgroup 2: A/B loads
EPI_LOAD_WARP = PRODUCER_WARP + 1  # second warp of warpgroup 2: epilogue operand loads
#: Registers per thread after ``setmaxnreg``: the producer warps run a loop of TMA issues
#: and fit in 24 (the split FlashAttention-3 uses for two consumer warpgroups), the
#: consumers take the rest: 24 x 128 + 240 x 256 = 64512 of the SM's 65536. The
#: consumers' 128 x 128 fp32 accumulator is 128 of them; with 232 (a 40 / 232 split)
#: cooperative tiles' log-sum-exp and SiLU + max epilogues spilled 1-3 registers, and so
#: did PingPong's log-sum-exp with its two-instruction exp (``LogSumExp``).
REGS_PRODUCER = 24
REGS_CONSUMER = 240


class Barrier:
    """Named-barrier ids (0 is __syncthreads)."""

    EPI = 1  # + wg: the 128 threads of one consumer warpgroup
    MMA_TURN = 3  # + wg: ordering of WGMMA mainloops
    EPI_TURN = 5  # + wg: ordering of epilogues
