"""coda.fusions.ce_fused: the LM-head cross-entropy with its gradients computed in the forward.

Sits in ``coda.fusions`` beside ``cross_entropy`` (whose ``linear_cross_entropy`` picks
this path or the recompute one), on ``ce_epilogues`` (the epilogues), ``ce_chunks`` (row
chunks, workspace), ``ce_operands`` (checks, targets) and ``_dispatch`` (fused kernel on
CUDA, the epilogues' reference on CPU).

Two custom ops. ``coda::lce_fused_loss(h, W, target, bias, rstd, denom, ...) -> (loss,
dh, dW, dbias, drstd, dl_last, dl_tail, dl_scale, dl_smooth, ent, lse)``: the scalar loss
sum_rows(row loss) / denom and its gradients for an upstream gradient of 1, three
logits-sized GEMMs in all (the
recompute path of ``cross_entropy`` runs four). How the upstream gradient g reaches them
(measured on the H200, 2026-11-26, ``docs/cross-entropy.md``):

* every chunk but the last: the forward computes its dh rows and, with several row
  chunks, the fp32 dW sum;
* the last (with one row chunk, the only) chunk: its dlogits stay in the row buffer
  (``dl_last``, the tail's ``dl_tail``) and the backward's ``coda::lce_fused_finish``
  runs that chunk's dh and dW GEMMs with g folded into their epilogue
  (``scaled_total_epilogue``: g * (acc [+ the fp32 sum]), rounded once into the input's
  dtype) on the plain GEMM's tiles (``BACKWARD_TILES``: 256-row cooperative ones on these
  long-running problems) and multiplies the earlier dh rows, dbias and drstd (O(M H + V)
  elements) by g: no cast or scaling pass over V x H runs.
* ``DEFER_ONE_CHUNK = False`` keeps the earlier one-chunk path for A/B: the forward
  computes dh and dW whole with plain GEMMs and the backward multiplies them by g
  (``_foreach_mul_``, in place unless the graph is kept); measured slower (below).
* per-row losses (``per_row``: the (M,) row losses, any upstream gradient): ONE chunk of
  every row, deferred; the backward's g (M,) scales the rows of dlogits, so it joins the
  dh GEMM's row factor, dW's operand g * h, the tail's and label smoothing's per-row
  terms; dbias the stored dlogits' column sums weighted by g (``lce_weighted_colsum``:
  a bias takes the map pass, whose dlogits are stored).

Per chunk of ``rows`` rows [r0, r1) (m rows; V' = ``ce_chunks.main_cols(V)``, V without
its V mod 8 tail):

1. logits GEMM h_c @ W[:V'].T with ``stats_store_epilogue``: acc rounded to h's dtype
   (``ACC_STORE_DTYPE``) stored into row buffer 1 (m x V'), and lse, zt, zsum of the
   rows from those rounded values;
2. the V mod 8 (<= 7) tail columns in plain torch, fp32, on (m, <= 7) tensors, merged
   into the statistics (logaddexp, sums);
3. the row losses, and the per-row upstream coefficients in closed form (no sync), with
   s = 1 / denom on valid rows and 0 on ignored ones: ga = dL/dlse = s (1 + 2 z_loss lse),
   gt = dL/dzt = -s (1 - eps), gs = dL/dzsum = -s eps / V (eps: label smoothing);
4. ``run_map`` of ``grad_map_epilogue`` over buffer 1: dlogits = rstd * dL/ds (h's
   dtype) written IN PLACE over the stored acc when that has h's dtype too (the default;
   a separate buffer 2 when ``ACC_STORE_DTYPE`` differs), and the dbias (column) / drstd
   (row) reductions; the tail's gradient in torch;
5. dh[r0:r1] = dlogits @ W[:V'] (+ the tail's, in fp32, rounded once), and with one
   chunk dW = dlogits.T @ h_c in W's dtype; with several, for every chunk but the last,
   dW (+)= dlogits.T @ h_c into the fp32 V x H sum (the first chunk writes, the next add:
   ``accumulate=True``, TMA reduce-add), the last chunk's left to the backward (above).
   dW is never summed in bf16.

**The shifted softmax** (``GRAD_PASS``, the default where ``shifted_ok`` and the
statistics are taken in the logits GEMM's epilogue; ``_Walk._shifted_chunk``): step 1
stores R = exp(z - c) against a per-row shift c (the target's logit + ``SHIFT_MARGIN``,
one dot product per row beforehand) instead of the rounded acc, beside the exact lse and
zt of the fp32 acc; the softmax is then R times the row factor s = ga exp(c - lse), the
target's entry of R is set to its whole gradient over s (fp32), and step 4 disappears:
dh = s * (R @ W) (the factor in the dh GEMM's epilogue), dW (+)= R.T @ (s * h) (on the
other operand), drstd = h . dh / rstd; label smoothing's per-row constant as rank-1
terms of dh and dW. docs/cross-entropy.md, "The shifted softmax".

In place (step 4) is safe in the engine: each address of the buffer is in exactly one
(tile, subtile) box, the same box for the stored-acc TMA load and the dlogits TMA store
(same dtype, width 1; split-K is never used with M x N loads); the consumer waits for that
subtile's load (its mbarrier) before it computes and stores it, and the loads the
producer warp prefetches ahead are of later subtiles and tiles, other addresses. It halves
the row buffers.

Precision: acc is rounded to h's dtype once
(``RoundTo`` in ``stats_store_epilogue``) and everything of the loss, lse, zt, zsum and
the gradient's softmax exp(z - lse), is computed in fp32 from those same rounded values,
as a loss over materialized bf16 logits is (consistent: the softmax sums to 1). Measured
on CPU, bf16: dh and dW errors against float64 0.2x-0.6x eager bf16 PyTorch's; the
recompute path (fp32 acc throughout) is a little closer still. ``ACC_STORE_DTYPE =
torch.float32`` stores the acc in fp32: the recompute path's algebra exactly, for 2 more
bytes written and read per logit.
"""

from __future__ import annotations

import functools

import attrs
import torch
from torch.library import custom_op

from coda.fusions import ce_chunks
from coda.fusions._dispatch import (
    EagerOp,
    matmul,
    register_formula,
    run_epilogue,
    run_map,
    uses_kernels,
)
from coda.fusions.ce_epilogues import (
    GRAD_SCALE,
    PARTIAL_SUM,
    RANK_COL,
    RANK_ROW,
    ROW_SCALE,
    SCALED,
    SHIFT,
    SHIFT_CLAMP,
    SHIFTED,
    STORED_ACC,
    TOTAL,
    UNSCALED,
    WEIGHTED_COLSUM,
    grad_map_epilogue,
    row_scaled_epilogue,
    scaled_total_epilogue,
    shifted_map_epilogue,
    shifted_store_epilogue,
    stats_map_epilogue,
    stats_store_epilogue,
    weighted_colsum_epilogue,
)
from coda.fusions.ce_operands import check_operands, check_targets, local_targets
from coda.mainloop.config import GemmConfig, choose_config, long_running
from coda.runtime import checks

__all__ = [
    "ACC_STORE_DTYPE",
    "GRAD_PASS",
    "SHIFT_MARGIN",
    "STATS_PASS",
    "fused_loss",
    "lce_fused_finish",
    "lce_fused_loss",
    "merge_entropy",
    "per_row_problem",
    "shifted_ok",
    "stats_by_map",
]

F32 = torch.float32

#: ``config`` of the backward's two GEMMs (``scaled_total_epilogue``): "gemm", the plain
#: GEMM's tile (``coda.gemm``'s pick: 256-row cooperative tiles on these long-running
#: GEMMs, both warpgroups storing their scaled halves at once). Their epilogue is next to
#: nothing beside a mainloop of K = V or K = tokens; on the fused default 128 x 128 tiles
#: (None) the one-chunk deferral ran 1.11-1.19x torch.compile's fwd+bwd on the H200
#: (2026-11-26).
BACKWARD_TILES: str | None = "gemm"
#: Config of the row chunks' dh GEMM computed in the forward (rows x H, K = V; every
#: chunk but the deferred last has the full ``grad_rows``), and of their dW GEMM below
#: (None: the heuristic's tile for the GEMM, as ``coda.gemm`` / a fused call pick it).
#: dh on cooperative 256 x 128 tiles, chosen by the whole pass: forward + backward
#: against the heuristic's 128 x 128 PingPong tiles in the same rounds, H200, V = 128256,
#: at (H, M) = (2048, 8192) / (2048, 16384) / (4096, 16384): 0.984 / 0.990 / 0.980 in a
#: 7-round A/B, 11 of 13 readings over five runs below 1. Those runs timed the
#: heuristic's tile as an A/B extra in a fixed place of each round; a run with the order
#: rotated and a same-path control (``results/cross_entropy_dh_rotated_h200.json``) read
#: the extra 2.0% slow where both run the same path and 1.1-2.6% slow at these shapes:
#: within that bias, so the tile is neutral as far as measured (docs/cross-entropy.md,
#: "Measured"), and it stays.
CHUNK_DH_TILES: GemmConfig | str | None = GemmConfig(tile_m=256, tile_n=128)
#: The dW GEMM of a row chunk (V x H, K = the chunk's rows, A M-major, B N-major, fp32
#: reduce-add into the dW sum) on 128 x 160 tiles: the heuristic's 128 x 128 reads the big
#: operand (dlogits.T, V x rows) once per 128 columns of H, 160 once per 160. Measured on
#: an H200 (2026-11-26, eight 2048-row chunks of V = 128256, interleaved, medians):
#: 25.32 ms against 26.24 at H = 4096 and 12.23 against 12.65 at H = 2048, 1.02x cuBLAS's
#: one whole-M dW GEMM (24.82 / 11.93); 128 x 192, 1 x 2 / 1 x 1 / 2 x 2 clusters, swizzle
#: groups of 4 / 16 and cooperative 256-row tiles were all slower
#: (docs/cross-entropy-history.md, "The dW GEMM's tile"). With ``DEFER_ONE_CHUNK`` off, the one
#: chunk's dW GEMM in the forward takes it too (its kernels, with and without label
#: smoothing's rank term, compile spill-free on it; that opt-in path is not timed on it).
CHUNK_DW_TILES: GemmConfig | str | None = GemmConfig(tile_m=128, tile_n=160, cluster_m=2)


#: Where the forward takes the logits' statistics (lse, z[target], sum z) of a row chunk:
#: "epilogue" in the logits GEMM's own epilogue (``stats_store_epilogue``, on the fused
#: PingPong tiles); "map": the logits GEMM plain (``coda.gemm``'s tiles: cooperative
#: 256-row ones on long-running problems, fewer operand bytes per FLOP, which at the power
#: limit is clock) storing the rounded acc, then a map pass over that stored acc
#: (``stats_map_epilogue``): one more read of the row buffer. The same values either way.
#: "auto" (the default): "map" where the chunk's logits GEMM is long-running
#: (``LONG_RUN_FLOPS``) with K = H >= ``STATS_MAP_MIN_K``. Read at call time.
STATS_PASS: str = "auto"
#: Smallest H at which "auto" takes the statistics by a map pass. Measured on an H200
#: (2026-11-26, ``benchmarks/cross_entropy.py``, one run, V = 128256, fwd+bwd vs the
#: epilogue): H = 8192 0.961x (M = 16384) and 0.976x (M = 8192); H = 4096 1.026x (one
#: chunk of 8192 rows, cooperative plain tiles) and 1.035x (M = 16384); H = 2048
#: 1.015-1.050x. The map pass's extra read costs M x V bytes whatever H is; the plain
#: GEMM's gain grows with its length.
STATS_MAP_MIN_K = 8192


def stats_by_map(rows: int, V: int, H: int) -> bool:
    """Whether a row chunk of ``rows`` rows takes its statistics by a map pass
    (``STATS_PASS``)."""
    if STATS_PASS == "auto":
        return H >= STATS_MAP_MIN_K and long_running(rows, V, H)
    if STATS_PASS in ("map", "epilogue"):
        return STATS_PASS == "map"
    raise ValueError(f"ce_fused.STATS_PASS must be 'auto', 'epilogue' or 'map'; got {STATS_PASS!r}")


#: Defer the last row chunk's dh and dW GEMMs to the backward with ONE row chunk too
#: (with several they always are). On: with the backward's GEMMs on the plain GEMM's
#: cooperative tiles (``BACKWARD_TILES``) it measured 0.998 / 1.010 / 1.002x
#: torch.compile's fwd+bwd at (H, M) = (4096, 8192) / (8192, 8192) / (8192, 16384)
#: where the forward-GEMM path (False: dh and dW in the forward on ``coda.gemm``, the
#: backward scaling them in place) took 1.018 / 1.028 / 1.026x in the same run
#: (``results/cross_entropy_h200.json``; 1.020 / 1.040 / 1.005 against 1.044 / 1.064 /
#: 1.054 in an earlier one), with a lower forward peak (H200, 2026-11-26). Read at call
#: time, by the op and its fake alike.
DEFER_ONE_CHUNK: bool = True

#: Input dtypes whose gradients the forward forms without the loss's 1 / denom (the
#: backward multiplies it in with the upstream gradient, in fp32, before rounding): fp16,
#: where softmax / tokens (~1e-9 at 16k tokens and V = 128256) would underflow fp16's
#: smallest subnormal (6e-8) in the stored dlogits before a ``GradScaler``'s scale is
#: known. Without the 1 / denom the dlogits are at most about 1 in magnitude and the
#: earlier chunks' dh rows the size of a row of W: inside fp16's range (the dW sum is
#: fp32). They take the "map" gradient pass (the shifted softmax exp(z - c) spans
#: e^-47..e^64, outside fp16's range); ``linear_cross_entropy`` sends them to the
#: recompute path with ``DEFER_ONE_CHUNK`` off (one chunk's dW formed in the forward, a
#: sum over rows without the 1 / denom, in fp16) or a bias that requires grad (dbias, a
#: sum over rows, likewise).
UNSCALED_DTYPES: tuple[torch.dtype, ...] = (torch.float16,)

#: dtype of the stored acc (row buffer 1): None stores it in h's dtype (the default: loss
#: and gradient from logits rounded once, as a materialized-logits loss has them; dlogits
#: then overwrite it in place, one row buffer); torch.float32 keeps the recompute path's
#: fp32 logits for twice the buffer's bytes and its write + read traffic, plus a second
#: (h's dtype) buffer for dlogits. Read at call time.
ACC_STORE_DTYPE: torch.dtype | None = None

#: How the gradient's softmax reaches the dh and dW GEMMs. "shifted" (where
#: ``shifted_ok``: no bias, no label smoothing with softcap, an rstd gradient only beside
#: dh, the acc stored in h's dtype): the logits GEMM's epilogue stores R = exp(z - c)
#: against a per-row shift c known before it (the target's logit + ``SHIFT_MARGIN``)
#: instead of z, the softmax is R
#: times a per-row factor, and no M x V pass runs between the GEMMs
#: (``_Walk._shifted_chunk``). "map": the logits stored, then the gradient map pass over
#: them (the other options' path). "auto" (the default): "shifted" where the row chunks
#: take their statistics in the logits GEMM's epilogue, "map" where they take them by a
#: map pass anyway (``stats_by_map``: H >= 8192 on long chunks). Measured on an H200
#: (2026-11-26, one run of ``benchmarks/cross_entropy.py``, fwd+bwd, shifted vs map):
#: 20.83 vs 21.38 ms at (H, M) = (2048, 8192), 42.51 vs 43.42 at (2048, 16384), 40.02 vs
#: 40.49 at (4096, 8192), 83.88 vs 83.71 at (4096, 16384); at H = 8192, where the
#: statistics come from a map pass, 78.81 vs 76.94 and 158.0 vs 156.2 (the shifted map
#: pass spares one read of the row buffer, but its extra per-row work and the pre-pass
#: did not pay there). Read at call time, by the op and its fake alike.
GRAD_PASS: str = "auto"
#: c = z[target] + SHIFT_MARGIN. R's entries run from exp(-87) (fp32's smallest normal;
#: below it they flush to 0) to exp(SHIFT_CLAMP): the softmax is exact for every entry
#: with p >= exp(-(87 - SHIFT_MARGIN)) = e^-47 (those below are dropped: they add at
#: most V e^-47 ~ 1e-15 of a row's gradient) in every row whose largest logit is within
#: SHIFT_MARGIN + SHIFT_CLAMP = 104 of its target logit (a loss below ~104 nats on that
#: row). Beyond that the largest logits' softmax weights saturate at exp(SHIFT_CLAMP)
#: (equal, finite); the loss, lse and every other row stay exact.
SHIFT_MARGIN: float = 40.0


@attrs.frozen
class _Spec:
    """The per-call constants of one fused loss: options and the gradients asked for."""

    V: int
    acc_dtype: torch.dtype
    out_dtype: torch.dtype
    ignore_index: int
    softcap: float | None
    eps: float
    z_loss: float
    bias_dtype: torch.dtype | None
    rstd: bool
    need_dh: bool
    need_dW: bool
    need_dbias: bool
    need_drstd: bool
    #: the shifted-softmax gradient (``GRAD_PASS``, ``shifted_ok``)
    shifted: bool = False
    #: each row's softmax entropy too (``SoftmaxEntropy`` in the statistics' epilogue),
    #: an output without a gradient
    entropy: bool = False
    #: each row's log-sum-exp as an output too (without a gradient here)
    lse: bool = False

    @property
    def main(self) -> int:
        """Columns through the fused GEMM (whole groups of 8)."""
        return ce_chunks.main_cols(self.V)

    @property
    def tail(self) -> int:
        """The V mod 8 columns done in torch."""
        return self.V - self.main

    @property
    def with_sum(self) -> bool:
        return self.eps > 0

    @property
    def store(self) -> bool:
        """dlogits feed a GEMM (dh or dW asked for)."""
        return self.need_dh or self.need_dW


# ---- per-row math shared by the fused columns and the tail -------------------------------


def shifted_ok(
    out_dtype: torch.dtype,
    bias: bool,
    softcap: float | None,
    label_smoothing: float,
    need_dh: bool,
    need_dW: bool,
    need_drstd: bool,
) -> bool:
    """Whether a fused loss with these options takes the shifted-softmax gradient
    (``GRAD_PASS``): a GEMM needs dlogits, no bias (its gradient would be a column sum of
    the softmax), label smoothing only without softcap (its per-row constant becomes
    rank-1 terms of dh and dW, which softcap's per-element chain factor would break;
    that factor alone rides in R), an rstd
    gradient only beside dh (it is taken from the dh rows: drstd = h . dh / rstd; the
    row sums of R * acc beside the statistics would spill the 128 x 128 tile's registers,
    3 STL at sm_90a), the acc stored in h's dtype (``ACC_STORE_DTYPE`` None or
    equal), and that dtype not fp16 (R = exp(z - c) spans e^-47..e^64 of fp32's and
    bf16's 8-bit exponent: in fp16 it would underflow to 0 and overflow to inf)."""
    if GRAD_PASS not in ("auto", "shifted", "map"):
        raise ValueError(
            f"ce_fused.GRAD_PASS must be 'auto', 'shifted' or 'map'; got {GRAD_PASS!r}"
        )
    return (
        GRAD_PASS != "map"
        and (need_dh or need_dW)
        and not bias
        and (not label_smoothing or softcap is None)
        and (need_dh or not need_drstd)
        and ACC_STORE_DTYPE in (None, out_dtype)
        and out_dtype != torch.float16
    )


def _takes_shifted(eligible: bool, rows: int, V: int, H: int) -> bool:
    """The shifted softmax for a call whose options allow it (``shifted_ok``), in row
    chunks of ``rows`` rows: always with ``GRAD_PASS = "shifted"``, with "auto" where
    those chunks take their statistics in the logits GEMM's epilogue."""
    if not eligible:
        return False
    return GRAD_PASS == "shifted" or not stats_by_map(rows, ce_chunks.main_cols(V), H)


def _row_losses(spec: _Spec, lse, zt, zsum, valid) -> torch.Tensor:
    """The loss of each row (0 for ignored rows), as ``linear_cross_entropy`` builds it."""
    rows = lse - zt
    if spec.with_sum:
        rows = (1.0 - spec.eps) * rows + spec.eps * (lse - zsum / spec.V)
    if spec.z_loss:
        rows = rows + torch.where(valid, spec.z_loss * lse * lse, 0.0)
    return torch.where(valid, rows, 0.0)


def _coefficients(spec: _Spec, lse, valid, inv, w=None) -> tuple[torch.Tensor, ...]:
    """(ga, gt, gs): d loss / d (lse, zt, zsum) per row for an upstream gradient of 1, with
    ``inv`` = 1 / denom (a 0-dim device tensor) on valid rows, 0 on ignored ones (``w``:
    that weight per row when already made); gs is None without label smoothing."""
    if w is None:
        w = valid.to(F32) * inv
    ga = w * (1.0 + 2.0 * spec.z_loss * lse) if spec.z_loss else w
    gt = w * -(1.0 - spec.eps)
    gs = w * (-spec.eps / spec.V) if spec.with_sum else None
    return ga, gt, gs


# ---- the V mod 8 tail in torch ------------------------------------------------------------


@attrs.frozen
class _Tail:
    """fp32 (m, V mod 8) tensors of the tail columns: acc, z and the one-hot targets."""

    acc: torch.Tensor
    z: torch.Tensor
    hit: torch.Tensor

    def stats(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lse, zt, zsum) over the tail columns."""
        return torch.logsumexp(self.z, 1), (self.z * self.hit).sum(1), self.z.sum(1)

    def entropy(self) -> torch.Tensor:
        """The entropy of the softmax over the tail columns alone, per row."""
        logp = torch.log_softmax(self.z, 1)
        return -(torch.exp(logp) * logp).sum(1)

    def grad(self, spec: _Spec, lse, ga, gt, gs) -> torch.Tensor:
        """dL/ds of the tail columns (the chain of ``ce_epilogues._grad``)."""
        g = ga[:, None] * torch.exp(self.z - lse[:, None]) + gt[:, None] * self.hit
        if gs is not None:
            g = g + gs[:, None]
        if spec.softcap is not None:
            u = self.z * (1.0 / spec.softcap)
            g = g - g * (u * u)
        return g


def merge_entropy(parts, lse: torch.Tensor) -> torch.Tensor:
    """The entropy of the softmax over a union of disjoint column sets, from each set's
    (lse_c, entropy_c) and the union's ``lse``: H = sum_c p(c) (H_c + lse - lse_c) with
    p(c) = exp(lse_c - lse), the set's probability (a set of probability 0 adds 0)."""
    total = torch.zeros_like(lse)
    for lse_c, ent_c in parts:
        p = torch.exp(lse_c - lse)
        total += torch.where(p > 0, p * (ent_c + (lse - lse_c)), 0.0)
    return total


def _tail(spec: _Spec, hf, W_tail, bias_tail, r_c, t_c, valid_c) -> _Tail:
    """The tail's logits from ``hf`` (the chunk's rows in fp32)."""
    acc = hf @ W_tail.float().T
    s = acc if r_c is None else acc * r_c[:, None]
    if bias_tail is not None:
        s = s + bias_tail.float()
    z = s if spec.softcap is None else spec.softcap * torch.tanh(s * (1.0 / spec.softcap))
    cols = torch.arange(spec.tail, device=hf.device) + spec.main
    hit = ((t_c[:, None] == cols) & valid_c[:, None]).to(F32)
    return _Tail(acc, z, hit)


# ---- the walk over row chunks ---------------------------------------------------------------


def row_buffers(
    m: int, cols: int, acc_dtype: torch.dtype, out_dtype: torch.dtype, store: bool, device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored acc buffer, dlogits buffer) of m x cols: the SAME tensor when the dtypes
    agree (the map pass writes dlogits in place over the stored acc, see the module doc),
    a second one otherwise; no dlogits buffer when nothing stores them (``store``
    False: neither dh nor dW asked for)."""
    acc = torch.empty((m, cols), dtype=acc_dtype, device=device)
    if not store:
        return acc, None
    if out_dtype == acc_dtype:
        return acc, acc
    return acc, torch.empty((m, cols), dtype=out_dtype, device=device)


@attrs.frozen
class _RowPlan:
    """The shifted path's per-row vectors (all M rows, or one chunk's ``slice``): int32
    targets local to the fused columns (-1: none there), the fp32 shift c, the fp32
    loss weight w = valid / denom, whether the target is on the fused columns, and the
    int64 flat index of its entry in the chunk's row buffer R (0 where none)."""

    tloc: torch.Tensor
    shift: torch.Tensor
    w: torch.Tensor
    hit: torch.Tensor
    flat: torch.Tensor

    def slice(self, r0: int, r1: int) -> _RowPlan:
        return _RowPlan(*(x[r0:r1] for x in attrs.astuple(self, recurse=False)))


class _Walk:
    """One fused loss over row chunks: inputs, the row buffer(s), the accumulators."""

    def __init__(self, h, W, target, bias, rstd, denom, spec: _Spec, rows: int, weight=None):
        M, H = h.shape
        self.h, self.W, self.target, self.rstd, self.spec = h, W, target, rstd, spec
        self.denom, self.inv = denom, torch.reciprocal(denom)
        # the gradients' 1 / denom: fp16's are formed without it (``UNSCALED_DTYPES``)
        self.ginv = torch.ones_like(self.inv) if h.dtype in UNSCALED_DTYPES else self.inv
        self.weight = None if weight is None else weight.to(device=h.device, dtype=F32)
        self.plan = ce_chunks.row_chunks(M, rows)
        main = spec.main
        self.W_main, self.W_tail = W[:main], W[main:]
        self.b_main = self.b_tail = None
        if bias is not None:
            self.b_main, self.b_tail = bias[:main], bias[main:]
        self.valid = target != spec.ignore_index
        self.several = len(self.plan) > 1
        self.defer = self.several or DEFER_ONE_CHUNK
        self._allocate(M, H, W.shape[0])
        self.bufs = self._buffers(min(rows, M))
        self.last: tuple = (None, None, None)
        # the shifted path's label smoothing: gs (* rstd) per row, and colsum(W[:V'])
        self.smooth = self.wsum = None
        if spec.shifted and spec.with_sum:
            self.smooth = torch.zeros(M, dtype=F32, device=h.device)
            self.wsum = self.W_main.sum(0, dtype=F32)

    @functools.cached_property
    def ones(self) -> torch.Tensor:
        """fp32 ones (H,): the upstream-gradient column vector of the forward's scaled
        GEMMs (made on first use: a deferred last chunk needs none)."""
        return torch.ones(self.h.shape[1], dtype=F32, device=self.h.device)

    def _allocate(self, M: int, H: int, V: int) -> None:
        """The per-row losses and the gradients asked for: dh of the rows before the last
        chunk and, with several chunks, the fp32 dW sum of those chunks (the backward
        finishes both); with the last chunk not deferred (one chunk, ``DEFER_ONE_CHUNK``
        off) dh and dW whole in h's and W's dtypes; dbias in fp32."""
        spec, device = self.spec, self.h.device
        self.row_loss = torch.empty(M, dtype=F32, device=device)
        self.dh = self.dW = self.dW32 = None
        if spec.need_dh:  # deferred: the rows before the last chunk's
            row0 = self.plan[-1][0] if self.plan else 0
            self.dh = self.h.new_empty((row0 if self.defer else M, H))
        if spec.need_dW and self.several:
            self.dW32 = torch.empty((V, H), dtype=F32, device=device)
        elif spec.need_dW and not self.defer:
            self.dW = torch.empty_like(self.W)
        self.dbias = torch.zeros(V, dtype=F32, device=device) if spec.need_dbias else None
        self.ent = torch.empty(M, dtype=F32, device=device) if spec.entropy else None
        self.lse = torch.empty(M, dtype=F32, device=device) if spec.lse else None
        self.drstd = None
        if spec.need_drstd:  # the shifted path's deferred rows: the backward's, zeros here
            self.drstd = (torch.zeros if spec.shifted else torch.empty)(M, dtype=F32, device=device)

    def _buffers(self, m: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The row buffers (stored acc, dlogits: one tensor twice by default) on a Hopper
        GPU; the reference path returns new tensors instead."""
        if not uses_kernels(self.h) or self.spec.main == 0:
            return None
        spec = self.spec
        return row_buffers(m, spec.main, spec.acc_dtype, spec.out_dtype, spec.store, self.h.device)

    def run(self, per_row: bool = False) -> list[torch.Tensor | None]:
        """[loss, dh, dW, dbias, drstd, dl_last, dl_tail, dl_scale, dl_smooth] as
        ``lce_fused_loss`` returns
        them (dh and dW the partial ones when the last chunk is deferred; None: not
        made); ``per_row``: the loss of each row / denom, 0 on ignored rows."""
        self.row_plan = None
        if self.spec.shifted and self.spec.main:
            self.row_plan = self._row_plan()
        for i, (r0, r1) in enumerate(self.plan):
            self._chunk(i, r0, r1)
        if per_row:  # the shifted path's row losses are unmasked: where, not a product
            weighed = self.row_loss * self.inv
            if self.weight is not None:
                weighed = weighed * self.weight
            loss = torch.where(self.valid, weighed, 0.0)
        elif self.row_plan is None and self.weight is not None:
            loss = torch.dot(self.row_loss, self.weight) / self.denom
        elif self.row_plan is None:
            loss = self.row_loss.sum() / self.denom
        else:  # row_loss unmasked there: ignored rows weigh 0
            loss = torch.dot(self.row_loss, self.row_plan.w)
        dbias = None if self.dbias is None else self.dbias.to(self.spec.bias_dtype)
        dW = self.dW32 if self.several else self.dW
        return [
            loss, self.dh, dW, dbias, self.drstd, *self.last, self.smooth, self.ent, self.lse
        ]  # fmt: skip

    # ---- one row chunk ------------------------------------------------------------------
    def _chunk(self, i: int, r0: int, r1: int) -> None:
        spec = self.spec
        h_c, t_c, valid_c = self.h[r0:r1], self.target[r0:r1], self.valid[r0:r1]
        r_c = None if self.rstd is None else self.rstd[r0:r1]
        hf = h_c.float() if spec.tail else None
        if spec.shifted and spec.main:
            self._shifted_chunk(i, r0, r1, h_c, t_c, valid_c, r_c, hf)
            return
        tloc = local_targets(t_c, valid_c, 0, spec.main)
        stats = acc = ent = None
        if spec.main:
            stats, acc, ent = self._main_stats(h_c, tloc, r_c, r1 - r0)
        tail = _tail(spec, hf, self.W_tail, self.b_tail, r_c, t_c, valid_c) if spec.tail else None
        tstats = None if tail is None else tail.stats()
        lse, zt, zsum = _merge(stats, tstats)
        self._entropy(r0, r1, stats, ent, tail, tstats, lse)
        if self.lse is not None:
            self.lse[r0:r1] = lse
        self.row_loss[r0:r1] = _row_losses(spec, lse, zt, zsum, valid_c)
        w = self._row_weights(valid_c, r0, r1)
        ga, gt, gs = _coefficients(spec, lse, valid_c, self.ginv, w)
        dl = None
        if spec.main:
            dl = self._main_grads(acc, tloc, lse, ga, gt, gs, r_c, r0, r1)
        dl_t = None
        if tail is not None:
            dl_t = self._tail_grads(tail, lse, ga, gt, gs, r_c, r0, r1)
        if not spec.store:
            return
        if self.defer and i == len(self.plan) - 1:  # lce_fused_finish's GEMMs read these
            self.last = (dl, dl_t, None)
            return
        if spec.need_dh:
            self._dh(r0, r1, dl, dl_t)
        if spec.need_dW:
            self._dW(i, hf, h_c, dl, dl_t)

    def _entropy(self, r0: int, r1: int, main, ent, tail: _Tail | None, tstats, lse) -> None:
        """Rows r0:r1 of the softmax entropy (``spec.entropy``): the fused columns' (``ent``
        of the statistics ``main``, None without fused columns) merged with the tail's
        (``tstats``: its statistics, already taken)."""
        if self.ent is None:
            return
        if tail is None:
            self.ent[r0:r1] = ent
            return
        parts = [(tstats[0], tail.entropy())]
        if main is not None:
            parts.append((main[0], ent))
        self.ent[r0:r1] = merge_entropy(parts, lse)

    def _row_weights(self, valid: torch.Tensor, r0: int, r1: int) -> torch.Tensor:
        """Each row's weight in the loss's gradients, valid / denom (times ``row_weight``;
        fp16: valid without the 1 / denom, ``UNSCALED_DTYPES``), rows r0:r1."""
        w = torch.mul(valid, self.ginv)  # bool x fp32: one kernel
        return w if self.weight is None else w * self.weight[r0:r1]

    # ---- the shifted-softmax chunk (GRAD_PASS) ---------------------------------------------
    def _row_plan(self) -> _RowPlan:
        """The shifted path's per-row vectors of the whole call (``_RowPlan``), made once
        before the first chunk: a handful of M-long kernels, where per chunk they were
        dozens of launches of a few microseconds each."""
        spec, h, t, valid = self.spec, self.h, self.target, self.valid
        M = h.shape[0]
        tloc = local_targets(t, valid, 0, spec.main)
        w = self._row_weights(valid, 0, M)
        hit = tloc >= 0
        # R's flat index of each row's target entry (the chunks are consecutive runs of
        # ``rows`` rows of one row-major buffer of spec.main columns); 0 where none
        rows = self.plan[0][1] if M else 1
        if M <= rows:  # one chunk: the row's offset is its index times the row length
            flat = torch.arange(0, M * spec.main, spec.main, device=h.device)
        else:
            flat = torch.arange(M, device=h.device).remainder_(rows).mul_(spec.main)
        flat.add_(tloc.clamp(min=0))
        return _RowPlan(tloc, self._shift(), w, hit, flat)

    def _shifted_chunk(self, i, r0, r1, h_c, t_c, valid_c, r_c, hf) -> None:
        """One row chunk with the softmax left as R = exp(z - c) times a per-row factor:
        statistics and R from the logits GEMM (or its stored acc, ``stats_by_map``); the
        row losses; the factor sr = dL/dacc / R; the target's entry of R set to its whole
        gradient over sr; dh = sr * (R @ W) and dW (+)= R.T @ (sr * h) (see the module
        doc), with label smoothing plus their rank-1 terms, and drstd = h . dh / rstd; or
        those left to ``lce_fused_finish`` (and the backward) for the last chunk."""
        spec, m, rows = self.spec, r1 - r0, self.row_plan.slice(r0, r1)
        shift = rows.shift
        out = self._shifted_stats(h_c, rows.tloc, r_c, shift, m)
        R = out[SHIFTED]
        tail = _tail(spec, hf, self.W_tail, None, r_c, t_c, valid_c) if spec.tail else None
        main = (out["lse"], out["zt"], out["zsum"] if spec.with_sum else None)
        tstats = None if tail is None else tail.stats()
        lse, zt, zsum = _merge(main, tstats)
        self._entropy(r0, r1, main, out.get("ent"), tail, tstats, lse)
        if self.lse is not None:
            self.lse[r0:r1] = lse
        if spec.with_sum or spec.z_loss:
            self.row_loss[r0:r1] = _row_losses(spec, lse, zt, zsum, valid_c)
        else:  # lse - zt, weighed by w (0 on ignored rows) in the loss
            torch.sub(lse, zt, out=self.row_loss[r0:r1])
        ga, gt, gs = _coefficients(spec, lse, valid_c, self.inv, rows.w)
        rank = None  # label smoothing: dh += gs (* rstd) x colsum(W), dW += 1 x sum gs h
        if gs is not None:
            self.smooth[r0:r1] = gs if r_c is None else gs * r_c
            rank = (self.smooth[r0:r1], self.wsum)
        # s = dL/dz / R on the fused columns, sr = dL/dacc / R: 0 on ignored rows, where
        # ga is 0 and the (clamped) exponential finite
        s = ga * torch.exp(torch.clamp(shift - lse, max=80.0))
        sr = s if r_c is None else s * r_c
        # the target entry's (ga p_t + gt) / (ga p_t) - 1 + p_t: q = 1 + gt / ga, the
        # constant label_smoothing on every row that counts unless z-loss makes ga vary
        q = spec.eps if not spec.z_loss else 1.0 + gt / torch.where(ga != 0, ga, 1.0)
        self._patch_target(R, rows, q, out["zt"], lse, spec.softcap, spec.tail > 0)
        dl_t = None
        if tail is not None:
            dl_t = self._tail_grads(tail, lse, ga, gt, gs, r_c, r0, r1)
        if self.defer and i == len(self.plan) - 1:  # lce_fused_finish's GEMMs read these
            self.last = (R, dl_t, sr)  # (and the backward this chunk's drstd from its dh)
            return
        if spec.need_dh:
            partial = None if dl_t is None else dl_t @ self.W_tail.float()
            _scaled_gemm(
                self.dh[r0:r1], R, self.W_main.t(), self.ones,
                partial=partial, row_scale=sr, config=CHUNK_DH_TILES, rank=rank,
            )  # fmt: skip
        if spec.need_drstd:  # every column's, the tail's too: over the tail's own part
            self.drstd[r0:r1] = drstd_from_dh(h_c, self.dh[r0:r1], r_c)
        if not spec.need_dW:
            return
        dW_rank = None  # smoothing's dW term: here with one chunk, else in the backward
        if rank is not None and self.dW32 is None:
            ones = torch.ones(spec.main, dtype=F32, device=h_c.device)
            dW_rank = (ones, _row_weighted_sum(h_c, self.smooth[r0:r1]))
        self._dW(i, hf, _row_scaled(h_c, sr), R, dl_t, dW_rank)

    def _shift(self) -> torch.Tensor:
        """c = z[target] + ``SHIFT_MARGIN`` per row: one dot product of h with its
        target's weight row, the products in h's dtype and their sum in fp32 (c needs no
        more than a few nats of accuracy: R is exact for any c in its window), over
        slices of ``SLICE_ROWS`` rows (the gathered weight rows are a slice's temporary).
        The targets are clamped into [0, V) for the gather: an ignored row's c is then
        some other logit's (any finite c serves a row whose loss weight, and so whose
        factor s, is 0), an out-of-range target's likewise (its result is undefined
        unless the targets are checked)."""
        h, r = self.h, self.rstd
        index = self.target.clamp(0, self.W.shape[0] - 1)
        zt = torch.empty(h.shape[0], dtype=F32, device=h.device)
        for a, b in _slices(h.shape[0]):
            rows = self.W.index_select(0, index[a:b]).mul_(h[a:b])
            torch.sum(rows, 1, dtype=F32, out=zt[a:b])
        if r is not None:
            zt = zt * r
        cap = self.spec.softcap
        if cap is not None:
            zt = cap * torch.tanh(zt * (1.0 / cap))
        return zt.add_(SHIFT_MARGIN)

    def _shifted_stats(self, h_c, tloc, r_c, shift, m: int) -> dict:
        """lse, zt and R of the fused columns: the logits GEMM's epilogue, or
        (``stats_by_map``) the plain GEMM's stored acc and one map pass writing R over it."""
        spec = self.spec
        vec = {SHIFT: shift, **self._vectors(r_c)}
        if stats_by_map(m, spec.main, self.h.shape[1]):
            acc, on_device = self._stored_logits(h_c, m)
            epi = shifted_map_epilogue(
                spec.acc_dtype, spec.out_dtype, spec.rstd, spec.softcap, spec.with_sum,
                spec.entropy,
            )  # fmt: skip
            outputs = {SHIFTED: acc} if on_device else None
            return run_map(
                epi, m, spec.main, self.h, outputs, **{STORED_ACC: acc}, tloc=tloc, **vec
            )
        epi = shifted_store_epilogue(
            spec.out_dtype, spec.rstd, spec.softcap, spec.with_sum, spec.entropy
        )
        return run_epilogue(epi, h_c, self.W_main, self._out(SHIFTED, 0, m), tloc=tloc, **vec)

    @staticmethod
    def _patch_target(R, rows: _RowPlan, q, zt_main, lse, softcap, keep_misses) -> None:
        """R[row, target] = the target column's whole gradient over the row's factor s
        = ga exp(c - lse): (ga p_t + gt) / s = exp(lse - c) (expm1(zt - lse) + 1 + gt / ga),
        exact in fp32 where p_t - 1 would cancel in R's dtype (rows whose target is on the
        fused columns; exp(lse - c) capped as R is; ``q`` = 1 + gt / ga, a float or per
        row); with ``softcap`` times the target's chain factor 1 - (z_t / cap)^2, as
        every entry of R has its own. Rows without
        such a target write their first entry: with ``keep_misses`` (a V mod 8 tail,
        whose targets' rows count) its own value back, else the value computed (those
        rows are ignored ones, whose factor s is 0, or rows of out-of-range targets,
        whose result is undefined unless the targets are checked)."""
        value = torch.exp(torch.clamp(lse - rows.shift, max=SHIFT_CLAMP))
        e = torch.expm1(zt_main - lse)
        value.mul_(e if isinstance(q, float) and not q else e.add_(q))
        if softcap is not None:
            u = zt_main * (1.0 / softcap)
            value = value - value * (u * u)
        flat = R.view(-1)
        if keep_misses:
            value = torch.where(rows.hit, value, flat[rows.flat].float())
        flat[rows.flat] = value.to(R.dtype)

    def _stored_logits(self, h_c, m: int) -> tuple[torch.Tensor, bool]:
        """(acc, in the row buffer): the plain logits GEMM of the chunk's m rows, into
        row buffer 0 on a Hopper GPU; a new tensor from the reference path."""
        bufs = self._out(STORED_ACC, 0, m)
        if bufs is None:
            return matmul(h_c, self.W_main, out_dtype=self.spec.acc_dtype), False
        return matmul(h_c, self.W_main, out=bufs[STORED_ACC]), True

    def _main_stats(self, h_c, tloc, r_c, m: int):
        """Step 1: ((lse, zt, zsum), stored acc, entropy or None) of the fused columns."""
        spec = self.spec
        opts = (spec.bias_dtype, spec.rstd, spec.softcap, spec.with_sum, spec.entropy)
        if stats_by_map(m, spec.main, self.h.shape[1]):
            acc, _ = self._stored_logits(h_c, m)
            out = run_map(
                stats_map_epilogue(spec.acc_dtype, *opts), m, spec.main, self.h,
                **{STORED_ACC: acc}, tloc=tloc, **self._vectors(r_c),
            )  # fmt: skip
        else:
            epi = stats_store_epilogue(spec.acc_dtype, *opts)
            out = run_epilogue(
                epi, h_c, self.W_main, self._out(STORED_ACC, 0, m), tloc=tloc,
                **self._vectors(r_c),
            )  # fmt: skip
            acc = out[STORED_ACC]
        zsum = out["zsum"] if spec.with_sum else None
        return (out["lse"], out["zt"], zsum), acc, out.get("ent")

    def _main_grads(self, acc, tloc, lse, ga, gt, gs, r_c, r0: int, r1: int):
        """Step 4 on the fused columns: dlogits (None when no GEMM needs them); dbias and
        drstd accumulated."""
        spec = self.spec
        epi = grad_map_epilogue(
            spec.acc_dtype, spec.out_dtype if spec.store else None, spec.bias_dtype, spec.rstd,
            spec.softcap, spec.with_sum, spec.need_dbias, spec.need_drstd,
        )  # fmt: skip
        rows = {"lse": lse, "ga": ga, "gt": gt}
        if gs is not None:
            rows["gs"] = gs
        m = r1 - r0
        outputs = self._out("dlogits", 1, m) if spec.store else None
        out = run_map(
            epi, m, spec.main, self.h, outputs, **{STORED_ACC: acc}, tloc=tloc, **rows,
            **self._vectors(r_c),
        )  # fmt: skip
        if spec.need_dbias:
            self.dbias[: spec.main] += out["dbias"]
        if spec.need_drstd:
            self.drstd[r0:r1] = out["drstd"]
        return out["dlogits"] if spec.store else None

    def _tail_grads(self, tail: _Tail, lse, ga, gt, gs, r_c, r0: int, r1: int):
        """Step 4 on the tail columns: fp32 dlogits; dbias and drstd accumulated."""
        spec = self.spec
        g = tail.grad(spec, lse, ga, gt, gs)
        if spec.need_dbias:
            self.dbias[spec.main :] += g.sum(0)
        if spec.need_drstd:
            part = (g * tail.acc).sum(1)
            self.drstd[r0:r1] = part if not spec.main else self.drstd[r0:r1] + part
        return g if r_c is None else g * r_c[:, None]

    def _dh(self, r0: int, r1: int, dl, dl_t) -> None:
        """Step 5: dh of the chunk's rows, rounded once into h's dtype."""
        out = self.dh[r0:r1]
        if dl_t is None:
            matmul(dl, self.W_main.t(), out=out, config=CHUNK_DH_TILES)
            return
        acc = dl_t @ self.W_tail.float()
        if dl is not None:
            matmul(dl, self.W_main.t(), out=acc, accumulate=True, config=CHUNK_DH_TILES)
        out.copy_(acc)

    def _dW(self, i: int, hf, h_c, dl, dl_t, rank=None) -> None:
        """Step 5 of a chunk not deferred: dW = dlogits.T @ h_c in W's dtype with one row
        chunk (``DEFER_ONE_CHUNK`` off); with several, the fp32 dW sum (+)= it (the first
        chunk writes, the next ones add; the backward adds the last chunk's and rounds
        once). The shifted path passes ``h_c`` = sr * h (the GEMM's operand); the tail's
        fp32 dlogits then multiply ``hf`` (the chunk's h in fp32) all the same, and with
        one chunk its label-smoothing ``rank`` term (row, column vectors) into the GEMM's
        epilogue."""
        main = self.spec.main
        if self.dW32 is None:
            if dl is not None and rank is not None:
                _scaled_gemm(
                    self.dW[:main], dl.t(), h_c.t(), self.ones, config=CHUNK_DW_TILES, rank=rank
                )
            elif dl is not None:
                matmul(dl.t(), h_c.t(), out=self.dW[:main], config=CHUNK_DW_TILES)
            if dl_t is not None:
                self.dW[main:] = (dl_t.T @ hf).to(self.W.dtype)
            return
        if dl is not None:
            matmul(dl.t(), h_c.t(), out=self.dW32[:main], accumulate=i > 0, config=CHUNK_DW_TILES)
        if dl_t is not None:
            part = dl_t.T @ hf
            if i == 0:
                self.dW32[main:] = part
            else:
                self.dW32[main:] += part

    # ---- operands ------------------------------------------------------------------------
    def _out(self, name: str, which: int, m: int) -> dict[str, torch.Tensor] | None:
        """``{name: row buffer which, first m rows}`` on CUDA, None on CPU."""
        return None if self.bufs is None else {name: self.bufs[which][:m]}

    def _vectors(self, r_c) -> dict[str, torch.Tensor]:
        """The rstd / bias vectors the epilogues bind, as enabled."""
        out = {}
        if r_c is not None:
            out["rstd"] = r_c
        if self.b_main is not None:
            out["bias"] = self.b_main
        return out


def _merge(main, tail):
    """(lse, zt, zsum) of all columns from those of the fused columns and of the tail
    (either may be None; zsum None without label smoothing on the fused side)."""
    if tail is None:
        return main
    if main is None:
        return tail
    lse = torch.logaddexp(main[0], tail[0])
    zsum = None if main[2] is None else main[2] + tail[2]
    return lse, main[1] + tail[1], zsum


# ---- the op --------------------------------------------------------------------------------


def _chunk_rows(h, W, chunk_rows: int, need_dW: bool, per_row: bool = False) -> int:
    """Rows per chunk: ``chunk_rows``, or 0 for ``ce_chunks.grad_rows``; ``per_row``: one
    chunk of every row, whatever ``chunk_rows`` (the op and its fake implementation
    agree: the fake's output shapes depend on it)."""
    if per_row:
        return ce_chunks.round_up(max(h.shape[0], 1), ce_chunks.ROW_STEP)
    acc_dtype = ACC_STORE_DTYPE or h.dtype
    return chunk_rows or ce_chunks.grad_rows(
        h.shape[0],
        W.shape[0],
        acc_dtype.itemsize,
        dw_hidden=W.shape[1] if need_dW else 0,
        deferred=DEFER_ONE_CHUNK,
    )


def _last_chunk(M, rows: int) -> tuple[bool, int]:
    """(several row chunks, rows of the last one) for M rows in chunks of ``rows``, by
    arithmetic (no Python range: M may be a symbolic size in the fake implementation)."""
    if M <= rows:
        return False, M
    return True, M - ((M - 1) // rows) * rows


def _outputs_like(
    h, W, bias, rstd, rows: int, need: tuple[bool, ...], shifted: bool = False,
    smoothing: bool = False, per_row: bool = False, entropy: bool = False, lse: bool = False,
) -> list:  # fmt: skip
    """Empty tensors of the op's outputs, shape (0,) where not made: the fp32 loss, 0-dim
    (or (M,) with ``per_row``); dh_part (rows before the last chunk, H) in h's dtype;
    with several row chunks the fp32 dW_part (V, H) of the chunks before the last; dbias
    (V,) in bias's dtype, fp32 drstd (M,); when dh or dW is asked for, the last chunk's
    dlogits (m_last, V') in h's dtype and its tail's fp32 (m_last, V mod 8), and on the
    ``shifted`` path the fp32 row factor (m_last,) of the last chunk's R (its dlogits
    are R times it) and, with label smoothing, the fp32 per-row gs (* rstd) of every row
    (M,); with ``entropy`` each row's fp32 softmax entropy (M,), with ``lse`` its fp32
    log-sum-exp (M,). With the last chunk not deferred (one chunk, ``DEFER_ONE_CHUNK``
    off): dh (M, H) and dW (V, H) whole, no dlogits."""
    need_dh, need_dW, need_dbias, need_drstd = need
    M, H = h.shape
    V = W.shape[0]
    main = ce_chunks.main_cols(V)
    several, m_last = _last_chunk(M, rows)
    defer = several or DEFER_ONE_CHUNK
    last = defer and (need_dh or need_dW)
    grad_dtype = bias.dtype if bias is not None else h.dtype
    return [
        h.new_empty((M,) if per_row else (), dtype=F32),
        h.new_empty(((M - m_last) if defer else M, H) if need_dh else (0,)),
        W.new_empty(
            (V, H) if need_dW and (several or not defer) else (0,),
            dtype=F32 if several else W.dtype,
        ),  # fmt: skip
        W.new_empty((V,) if need_dbias else (0,), dtype=grad_dtype),
        h.new_empty((M,) if need_drstd else (0,), dtype=F32),
        h.new_empty((m_last, main) if last and main else (0,)),
        h.new_empty((m_last, V - main) if last and V - main else (0,), dtype=F32),
        h.new_empty((m_last,) if last and main and shifted else (0,), dtype=F32),
        h.new_empty((M,) if shifted and smoothing and main else (0,), dtype=F32),
        h.new_empty((M,) if entropy else (0,), dtype=F32),
        h.new_empty((M,) if lse else (0,), dtype=F32),
    ]


def _fused_loss(
    h: torch.Tensor,
    W: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    rstd: torch.Tensor | None,
    denom: torch.Tensor,
    ignore_index: int,
    softcap: float | None,
    label_smoothing: float,
    z_loss: float,
    chunk_rows: int,
    check: bool,
    need_dh: bool,
    need_dW: bool,
    need_dbias: bool,
    need_drstd: bool,
    per_row: bool = False,
    row_weight: torch.Tensor | None = None,
    entropy: bool = False,
    return_lse: bool = False,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
]:  # fmt: skip
    """(loss, dh, dW, dbias, drstd, dl_last, dl_tail, dl_scale, dl_smooth, ent, lse): the fp32
    scalar loss
    sum_rows(row loss) / ``denom`` (a 0-dim fp32 tensor: the valid-row count, 1, or
    num_items_in_batch) of the logits softcap(rstd * h @ W.T + bias), and its gradients
    for an upstream gradient of 1: dbias (bias's dtype) and drstd (fp32); dh of the rows
    before the last chunk, with several chunks the fp32 dW sum of the chunks before the
    last, and the last chunk's dlogits (h's dtype; the V mod 8 tail's in fp32; on the
    shifted path (``GRAD_PASS``) R and its fp32 row factor ``dl_scale``, and with label
    smoothing ``dl_smooth``, gs (* rstd) of every row), which
    ``lce_fused_finish`` turns into dh and dW (with ``DEFER_ONE_CHUNK`` off and one row
    chunk: dh and dW whole in h's and W's dtypes, dl_last and dl_tail empty). Each is
    shape (0,) where not asked for (``need_*``). ``chunk_rows``: rows per chunk, 0 for
    ``ce_chunks.grad_rows``.

    ``per_row``: the loss is the (M,) fp32 row losses / ``denom`` (0 on ignored rows) and
    takes any upstream gradient, one per row: every row goes in ONE chunk (``chunk_rows``
    is not read; an M x V' row buffer), whose dh and dW GEMMs are deferred to the backward
    (``DEFER_ONE_CHUNK`` must be on), where the upstream gradient g scales the rows of
    dlogits (dh = g * (dlogits @ W), dW = dlogits.T @ (g * h)); dbias is not made here
    but in the backward, a g-weighted column sum of the stored dlogits
    (``lce_weighted_colsum``).

    ``row_weight``: an fp32 (M,) weight of each row's loss (per-token weights of RL
    losses: the loss is sum_rows(weight * row loss) / denom), folded into the per-row
    coefficients of every gradient; data only (it must not require grad here).

    ``entropy``: ``ent`` is each row's softmax entropy -sum_j p_j log p_j (fp32 (M,),
    ignored rows too), from ``SoftmaxEntropy`` in place of the log-sum-exp in the
    statistics' epilogue; an output without a gradient (the entropy's gradient is not a
    row scale of the softmax: ``linear_cross_entropy``'s recompute path has it).
    ``return_lse``: ``lse`` is each row's log-sum-exp (fp32 (M,)), likewise without a
    gradient here (``linear_cross_entropy`` attaches one, ``coda::lce_lse``).
    Targets are range-checked on the reference path (the CPU, other GPUs), and on a Hopper
    GPU when ``check`` (a device sync)."""
    check_operands(h, W, target, bias, rstd)
    V = W.shape[0]
    if check or not uses_kernels(h):
        check_targets(target, V, ignore_index)
    acc_dtype = ACC_STORE_DTYPE or h.dtype
    need_drstd = rstd is not None and need_drstd
    if per_row:
        _check_per_row()
        need_dbias = False  # the backward's (lce_weighted_colsum), with g
    eligible = shifted_ok(
        h.dtype, bias is not None, softcap, label_smoothing, need_dh, need_dW, need_drstd
    )
    rows = _chunk_rows(h, W, chunk_rows, need_dW, per_row)
    shifted = _takes_shifted(eligible, rows, V, h.shape[1])
    spec = _Spec(
        V, acc_dtype, h.dtype, ignore_index, softcap, float(label_smoothing), float(z_loss),
        None if bias is None else bias.dtype, rstd is not None,
        need_dh, need_dW, bias is not None and need_dbias, need_drstd, shifted, entropy,
        return_lse,
    )  # fmt: skip
    denom = denom.to(device=h.device, dtype=F32)
    walk = _Walk(h, W, target, bias, rstd, denom, spec, rows, row_weight)
    got = walk.run(per_row)
    empty = _outputs_like(h, W, bias, rstd, rows, (False,) * 4, per_row=per_row)
    return tuple(e if g is None else g for g, e in zip(got, empty, strict=True))


lce_fused_loss = custom_op("coda::lce_fused_loss", _fused_loss, mutates_args=())


@lce_fused_loss.register_fake
def _(
    h, W, target, bias, rstd, denom, ignore_index, softcap, label_smoothing, z_loss,
    chunk_rows, check, need_dh, need_dW, need_dbias, need_drstd, per_row=False,
    row_weight=None, entropy=False, return_lse=False,
):  # fmt: skip
    if per_row:
        _check_per_row()
    need_dbias = bias is not None and need_dbias and not per_row
    need = (need_dh, need_dW, need_dbias, rstd is not None and need_drstd)
    rows = _chunk_rows(h, W, chunk_rows, need_dW, per_row)
    eligible = shifted_ok(h.dtype, bias is not None, softcap, label_smoothing, *need[:2], need[3])
    shifted = _takes_shifted(eligible, rows, W.shape[0], h.shape[1])
    smoothing = bool(label_smoothing)
    return tuple(
        _outputs_like(
            h, W, bias, rstd, rows, need, shifted, smoothing, per_row, entropy, return_lse
        )
    )


def per_row_problem() -> str | None:
    """Why per-row losses cannot take the gradient-in-forward path (``lce_fused_loss``'s
    ``per_row``), or None when they can: ``DEFER_ONE_CHUNK`` off (the one chunk's GEMMs
    must wait for the upstream gradient). Read at call time."""
    if not DEFER_ONE_CHUNK:
        return "ce_fused.DEFER_ONE_CHUNK off (the GEMMs must wait for the upstream gradient)"
    return None


def _check_per_row() -> None:
    problem = per_row_problem()
    if problem is not None:
        raise ValueError(f"lce_fused_loss(per_row=True) cannot take {problem}")


# ---- the backward's GEMMs --------------------------------------------------------------------


def _scaled_gemm(out, A, B, gvec, *, partial=None, row_scale=None, config=None, rank=None) -> None:
    """out = g * ([row_scale *] A @ B.T [+ rank[0] x rank[1]] [+ partial]) rounded once
    into out's dtype, by ``scaled_total_epilogue`` on the GEMM (or in torch when there is
    no A: V < 8); ``config``: the GEMM's (default ``BACKWARD_TILES``). On the plain
    GEMM's tiles ("gemm"), where those tiles would keep fewer than half the clusters
    busy and ``coda.gemm``'s heuristic would split K for an fp32 output
    (``_split_config``: e.g. dh of a few hundred rows with K = V), the product runs
    split-K into an fp32 buffer and the (small) rest in torch (``_finish_split``),
    rounded once all the same."""
    if A is None:
        out.copy_(partial * gvec)
        return
    config = BACKWARD_TILES if config is None else config
    if config == "gemm" and uses_kernels(A):
        split = _split_config(A.shape[0], B.shape[0], A.shape[1], A.device)
        if split is not None:
            acc = torch.empty(out.shape, dtype=F32, device=out.device)
            matmul(A, B, out=acc, config=split)
            _finish_split(acc, out, gvec, partial=partial, row_scale=row_scale, rank=rank)
            return
    tensors = {GRAD_SCALE: gvec}
    if partial is not None:
        tensors[PARTIAL_SUM] = partial
    if row_scale is not None:
        tensors[ROW_SCALE] = row_scale
    if rank is not None:
        tensors[RANK_ROW], tensors[RANK_COL] = rank
    epi = scaled_total_epilogue(
        out.dtype, partial is not None, row_scale is not None, rank is not None
    )
    got = run_epilogue(epi, A, B, {TOTAL: out}, config=config, **tensors)[TOTAL]
    if got.data_ptr() != out.data_ptr():  # the CPU reference's new tensor
        out.copy_(got)


@functools.lru_cache(maxsize=1024)
def _split_config_cached(m: int, n: int, k: int, num_sms: int, short: bool) -> GemmConfig | None:
    plain = choose_config(m, n, k, num_sms, short_groups=short)
    rows = -(-m // plain.tile_m)
    units = -(-rows // plain.cluster_m) * -(-n // plain.tile_n)
    if 2 * units > num_sms // plain.cluster_m:
        return None
    cfg = choose_config(m, n, k, num_sms, split_ok=True, short_groups=short)
    return cfg if cfg.split_k > 1 else None


def _split_config(m: int, n: int, k: int, device: torch.device) -> GemmConfig | None:
    """The config ``coda.gemm``'s heuristic (``choose_config``) gives an (m, n, k) GEMM
    with an fp32 output when it splits K, for a GEMM whose plain config keeps fewer than
    half the clusters busy (None otherwise): its units of work then fill the GPU where the
    m x n output alone has too few tiles (at m = 256, n = 2048, k = 128256: 11 tiles of
    128 x 192 on 66 clusters, each 2004 k-tiles long; split 6 ways). Row chunks of the
    usual 2048 rows keep their unsplit GEMM. None under
    ``torch.use_deterministic_algorithms(True)``: the splits add in finishing order, so
    the unsplit GEMM (slower at such shapes, bitwise reproducible) runs instead."""
    if torch.are_deterministic_algorithms_enabled():
        return None
    sms = checks.hopper_device(device)
    return _split_config_cached(m, n, k, sms, checks.short_swizzle_groups(device))


def _finish_split(acc, out, gvec, *, partial=None, row_scale=None, rank=None) -> None:
    """out = gvec * ([row_scale *] acc [+ rank[0] x rank[1]] [+ partial]), rounded once
    into out's dtype: ``scaled_total_epilogue``'s arithmetic (the same order, fp32) on a
    product already summed in ``acc`` (fp32, overwritten)."""
    if row_scale is not None:
        acc.mul_(row_scale[:, None])
    if rank is not None:
        acc.addr_(rank[0], rank[1])
    if partial is not None:
        acc.add_(partial)
    torch.mul(acc, gvec, out=out)


#: rows per slice of the shifted path's O(rows x H) torch steps (the shift's gathered
#: weight rows, drstd's and label smoothing's fp32 products): their temporaries stay
#: below SLICE_ROWS x H x 4 bytes (32 MiB at H = 4096) whatever the chunk
SLICE_ROWS = 2048


def _slices(M) -> tuple:
    """Row ranges of ``SLICE_ROWS`` rows covering M rows; ONE range of every row where M
    is symbolic (a compiler traces the backward: its fused kernels keep no such
    temporaries, and a Python loop over a symbolic size would guard on it, one recompile
    per sequence length)."""
    if isinstance(M, torch.SymInt):
        return ((0, M),)
    return ce_chunks.row_chunks(M, SLICE_ROWS)


def drstd_from_dh(h: torch.Tensor, dh: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dL/drstd per row from dL/dh: with logits z = rstd * (h @ W.T),
    dL/drstd = sum_v dL/dz_v (h . W_v) = h . (dL/dh) / rstd, in fp32 (slice by slice,
    ``SLICE_ROWS``): the shifted path's rstd gradient, with no reduction beside the
    statistics in the logits GEMM."""
    out = torch.empty(h.shape[0], dtype=F32, device=h.device)
    for a, b in _slices(h.shape[0]):
        out[a:b] = (h[a:b].float() * dh[a:b].float()).sum(1)
    return out / rstd


def _row_weighted_sum(h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_m weights[m] h[m] in fp32 (H,), slice by slice (``SLICE_ROWS``): the shifted
    path's label-smoothing term of dW (every row of dW gains it)."""
    out = torch.zeros(h.shape[1], dtype=F32, device=h.device)
    for a, b in _slices(h.shape[0]):
        out += weights[a:b] @ h[a:b].float()
    return out


def _row_scaled(h: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """row_scale[:, None] * h in fp32, rounded once into h's dtype: the dW GEMM's operand
    on the shifted path (dW = R.T @ (sr * h)), by one map pass (``row_scaled_epilogue``:
    a read and a write of h's bytes on CUDA, where torch's mixed-dtype product would
    take an fp32 temporary and a cast)."""
    M, H = h.shape
    if not M:
        return torch.empty_like(h)
    outputs = {SCALED: torch.empty_like(h)} if uses_kernels(h) else None
    tensors = {UNSCALED: h, ROW_SCALE: row_scale}
    return run_map(row_scaled_epilogue(h.dtype), M, H, h, outputs, **tensors)[SCALED]


def _fused_finish(
    g: torch.Tensor,
    h: torch.Tensor,
    W: torch.Tensor,
    dh_part: torch.Tensor,
    dW_part: torch.Tensor,
    dl_last: torch.Tensor,
    dl_tail: torch.Tensor,
    dl_scale: torch.Tensor,
    dl_smooth: torch.Tensor,
    need_dh: bool,
    need_dW: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, dW) = g * the loss's gradients, from what ``lce_fused_loss`` left (its
    outputs 1, 2, 5, 6, 7, 8) and the upstream gradient ``g``: the last row chunk's
    dh and dW GEMMs with g and the fp32 partials folded into their epilogue, each
    written once in its input's dtype; the earlier dh rows times g (g rounded to h's
    dtype). ``g`` 0-dim (a scalar loss) or (M,) (``per_row`` losses, one chunk of every
    row): then g scales the rows of dlogits, in the dh GEMM's row scale and in dW's
    operand g * h (with the shifted path's factor, the tail's and label smoothing's
    terms). Each is shape (0,) unless asked for."""
    M, H = h.shape
    V = W.shape[0]
    main = ce_chunks.main_cols(V)
    last = dl_last if dl_last.dim() == 2 else dl_tail
    if last.dim() != 2:  # no rows (M = 0): zero gradients
        return (
            torch.zeros_like(h) if need_dh else h.new_empty((0,)),
            torch.zeros_like(W) if need_dW else W.new_empty((0,)),
        )
    row0 = M - last.shape[0]
    A = dl_last if main else None
    h_last = h[row0:]
    scale = dl_scale if main and dl_scale.numel() else None  # the shifted path's factor
    smooth = dl_smooth if main and dl_smooth.numel() else None  # ... and label smoothing's
    tail = dl_tail if V - main else None
    g = g.to(device=h.device, dtype=F32)
    if g.dim():  # per-row losses (row0 = 0): g into every per-row factor, none per column
        if row0:
            raise ValueError("per-row upstream gradients need one row chunk of every row")
        scale = g if scale is None or A is None else scale * g
        smooth = None if smooth is None else smooth * g
        tail = None if tail is None else tail * g[:, None]
        gvec = torch.ones(H, dtype=F32, device=h.device)
    else:
        gvec = g.reshape(1).expand(H).contiguous()
    # dW first: on the shifted path its operand sr * h (the last chunk's rows) is a
    # temporary that is freed before dh is allocated, so the peak stays R + dW + dh
    dW = W.new_empty((0,))
    if need_dW:
        several = dW_part.dim() == 2
        B = h_last if scale is None or not main else _row_scaled(h_last, scale)
        dW = torch.empty_like(W)
        rank = None
        if smooth is not None:  # every row of dW gains sum_m gs_m (rstd_m) h_m, over ALL rows
            ones = torch.ones(main, dtype=F32, device=W.device)
            rank = (ones, _row_weighted_sum(h, smooth))
        if main:
            partial = dW_part[:main] if several else None
            _scaled_gemm(dW[:main], A.t(), B.t(), gvec, partial=partial, rank=rank)
        del B
        if tail is not None:
            part = tail.T @ h_last.float()
            if several:
                part = part + dW_part[main:]
            dW[main:] = part * gvec
    dh = torch.empty_like(h) if need_dh else h.new_empty((0,))
    if need_dh:
        if row0 and h.dtype in UNSCALED_DTYPES:  # g holds the 1 / denom: the product in fp32
            dh[:row0] = dh_part[:row0].float().mul_(g)
        elif row0:
            torch.mul(dh_part[:row0], g.to(h.dtype), out=dh[:row0])
        partial = tail @ W[main:].float() if tail is not None else None
        rank = (smooth[row0:], W[:main].sum(0, dtype=F32)) if smooth is not None else None
        _scaled_gemm(dh[row0:], A, W[:main].t(), gvec, partial=partial, row_scale=scale, rank=rank)
    return dh, dW


lce_fused_finish = custom_op("coda::lce_fused_finish", _fused_finish, mutates_args=())


@lce_fused_finish.register_fake
def _(g, h, W, dh_part, dW_part, dl_last, dl_tail, dl_scale, dl_smooth, need_dh, need_dW):
    return (
        torch.empty_like(h) if need_dh else h.new_empty((0,)),
        torch.empty_like(W) if need_dW else W.new_empty((0,)),
    )


# ---- autograd ----------------------------------------------------------------------------------


def _fused_setup(ctx, inputs, output) -> None:
    ctx.need = (inputs[12], inputs[13], inputs[3] is not None and inputs[14],
                inputs[4] is not None and inputs[15])  # fmt: skip
    ctx.n_inputs = len(inputs)
    ctx.per_row = len(inputs) > 16 and bool(inputs[16])
    ctx.bias_dtype = None if inputs[3] is None else inputs[3].dtype
    weight = inputs[17] if len(inputs) > 17 else None
    if weight is not None and weight.requires_grad:
        raise ValueError(
            "coda::lce_fused_loss: row_weight is data here (it must not require grad); "
            "linear_cross_entropy takes a row_weight that requires grad on the recompute path"
        )
    ctx.save_for_backward(inputs[0], inputs[1], *output[1:9], inputs[4], inputs[5])
    ctx.mark_non_differentiable(*output[1:])
    # the forward's other outputs are never differentiated: no zero-filled (V x H for
    # the dW sum!) gradients materialized for them in the backward
    ctx.set_materialize_grads(False)


def _scaled(tensors: list, g: torch.Tensor, in_place: bool = False) -> list:
    """Each tensor (None kept) times the 0-dim ``g``, in its own dtype: one
    ``torch._foreach_mul`` per dtype with ``g`` cast to that dtype, out of place, or with
    ``in_place`` (``_foreach_mul_``) into the tensors themselves. The foreach kernel
    reads the scalar from device memory in a vectorized multi-tensor launch (its fast path
    wants the scalar in the list's dtype); ``t * g`` would instead broadcast the 0-dim
    CUDA tensor through TensorIterator's unvectorized dynamic-cast kernel, which rounded g
    to t's dtype too. Under ``create_graph`` with ``g`` requiring grad, plain ``t * g``
    (foreach ops cannot be differentiated with respect to a scalar tensor)."""
    if g.requires_grad and torch.is_grad_enabled():
        return [None if t is None else (t * g).to(t.dtype) for t in tensors]
    out = list(tensors)
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        group = [tensors[i] for i in idx]
        if in_place:
            torch._foreach_mul_(group, g.to(dtype))
            continue
        for i, t in zip(idx, torch._foreach_mul(group, g.to(dtype)), strict=True):
            out[i] = t
    return out


def _scale_in_place(g: torch.Tensor, saved: list) -> bool:
    """Whether the backward may scale the saved gradients in place and return them: this
    backward frees them when it ends (the graph is not retained, so no second backward
    reads them) and nothing traces it (no compiler, and plain tensors: no fake or
    functional ones of a tracer); ``_scaled`` itself keeps ``t * g`` out of place when
    something differentiates through the scaling (``create_graph``).
    Then no new dh / dW is allocated (at V = 128256, H = 8192 a 2 GiB dW: with the
    caching allocator fragmented by other large allocations, each such block can cost a
    cudaMalloc). The op's gradient outputs ARE the saved tensors: a caller of
    ``coda::lce_fused_loss`` itself who keeps them sees them scaled after the backward."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if keep_graph is None or torch.compiler.is_compiling():
        return False
    if any(type(t) is not torch.Tensor for t in [g, *saved] if t is not None):
        return False
    try:
        return not keep_graph()
    except RuntimeError:  # not inside a backward
        return False


def _with_last_rows(x: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor | None:
    """x with its last rows replaced by ``last`` (None: x as it is), out of place."""
    if last is None:
        return x
    return torch.cat([x[: x.shape[0] - last.shape[0]], last])


def _fused_backward(ctx, g_loss, *unused):
    """dh and dW by ``lce_fused_finish`` (the last row chunk's GEMMs, g folded into their
    epilogue) and dbias, drstd times g; with nothing deferred (one row chunk,
    ``DEFER_ONE_CHUNK`` off) the saved gradients times g (in place when
    ``_scale_in_place`` allows). Under ``create_graph`` with g
    requiring grad the GEMMs run for g = 1 and plain products by g follow (differentiable
    in g). Per-row losses (``per_row``): g (M,) into the GEMMs' row factors, drstd times
    it row by row; differentiating through g itself is not supported there."""
    rest = (None,) * (ctx.n_inputs - 5)
    if g_loss is None:
        return (None,) * 5 + rest
    saved = ctx.saved_tensors
    h, W, dh_saved, dW_saved, dbias, drstd, dl_last, dl_tail, dl_scale, dl_smooth, rstd, denom = (
        saved
    )
    need_dh, need_dW, need_dbias, need_drstd = ctx.need
    dbias, drstd = (dbias if need_dbias else None), (drstd if need_drstd else None)
    through_g = g_loss.requires_grad and torch.is_grad_enabled()
    if h.shape[0] == 0:  # no rows: the forward ran no GEMM, the gradients are zeros
        zeros = [torch.zeros_like(h), torch.zeros_like(W),
                 torch.zeros((W.shape[0],), dtype=ctx.bias_dtype or F32, device=W.device),
                 torch.zeros((0,), dtype=F32, device=h.device)]  # fmt: skip
        dh, dW, dbias, drstd = (z if n else None for z, n in zip(zeros, ctx.need, strict=True))
        return (dh, dW, None, dbias, drstd) + rest
    if ctx.per_row:
        return _per_row_backward(ctx, g_loss, through_g) + rest
    g_loss = _with_denominator(g_loss, h, denom)
    if dl_last.dim() != 2 and dl_tail.dim() != 2:  # nothing deferred: the gradients are whole
        saved = [dh_saved if need_dh else None, dW_saved if need_dW else None, dbias, drstd]
        dh, dW, dbias, drstd = _scaled(saved, g_loss, in_place=_scale_in_place(g_loss, saved))
        return (dh, dW, None, dbias, drstd) + rest
    g = torch.ones_like(g_loss) if through_g else g_loss
    dh, dW = _finish(
        g.detach(), h.detach(), W.detach(), dh_saved, dW_saved, dl_last, dl_tail, dl_scale,
        dl_smooth, need_dh, need_dW,
    )  # fmt: skip
    dh, dW = (dh if need_dh else None), (dW if need_dW else None)
    last_drstd = None
    if drstd is not None and dl_scale.numel():  # shifted: the last chunk's from its dh
        row0 = h.shape[0] - dl_scale.shape[0]
        last_drstd = drstd_from_dh(h.detach()[row0:], dh[row0:], rstd.detach()[row0:])
    if through_g:
        drstd = _with_last_rows(drstd, last_drstd)
        dh, dW, dbias, drstd = _scaled([dh, dW, dbias, drstd], g_loss)
    else:
        dbias, drstd = _scaled([dbias, drstd], g_loss)
        drstd = _with_last_rows(drstd, last_drstd)  # dh has g in it already
    return (dh, dW, None, dbias, drstd) + rest


def _with_denominator(g: torch.Tensor, h: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """The upstream gradient ``g`` times the loss's 1 / ``denom`` where the forward formed
    the gradients without it (``UNSCALED_DTYPES``: fp16), else ``g`` itself."""
    if h.dtype not in UNSCALED_DTYPES:
        return g
    return g / denom.to(device=g.device, dtype=F32)


def _per_row_backward(ctx, g_rows: torch.Tensor, through_g: bool) -> tuple:
    """(dh, dW, None, dbias, drstd) of per-row losses under the (M,) upstream gradient
    ``g_rows``: ``lce_fused_finish`` with g in the GEMMs' row factors; dbias the stored
    dlogits' column sums weighted by g / rstd (``lce_weighted_colsum``: with a bias the
    gradient pass is the map pass, whose dlogits are rstd dL/ds); drstd from the shifted
    path's dh, or the forward's (for g = 1) times g row by row."""
    if through_g:
        raise RuntimeError(
            "linear_cross_entropy: the gradients of per-row losses cannot be differentiated "
            "with respect to their upstream gradient (backward with create_graph=True and a "
            "gradient that requires grad)"
        )
    h, W, dh_saved, dW_saved, _, drstd, dl_last, dl_tail, dl_scale, dl_smooth, rstd, denom = (
        ctx.saved_tensors
    )
    need_dh, need_dW, need_dbias, need_drstd = ctx.need
    # (the upstream gradient of ``loss.sum()`` is one value expanded over the rows, stride
    # 0: ``run_epilogue`` copies it before a kernel loads it)
    g = _with_denominator(g_rows.detach().to(F32), h, denom)
    dh, dW = _finish(
        g, h, W, dh_saved, dW_saved, dl_last, dl_tail, dl_scale, dl_smooth, need_dh, need_dW
    )
    dbias = None
    if need_dbias:
        weight = g if rstd is None else g / rstd.detach().to(F32)
        dbias = _lce_weighted_colsum(dl_last, dl_tail, weight, W.shape[0]).to(ctx.bias_dtype)
    if not need_drstd:
        drstd = None
    elif dl_scale.numel():  # the shifted path's from dh (asked for beside it: ``shifted_ok``)
        drstd = drstd_from_dh(h, dh, rstd)
    else:
        drstd = drstd * g
    return (dh if need_dh else None), (dW if need_dW else None), None, dbias, drstd


def _lce_weighted_colsum_impl(
    dl_last: torch.Tensor, dl_tail: torch.Tensor, weight: torch.Tensor, V: int
) -> torch.Tensor:
    """sum_rows weight * dlogits per vocabulary column, fp32 (V,): the stored dlogits of
    the one row chunk (``dl_last``, V' columns in h's dtype; ``dl_tail``, the V mod 8
    columns in fp32; either shape (0,) when absent) weighted by the fp32 (M,) ``weight``.
    The fused columns by one map pass (``weighted_colsum_epilogue``), the tail in torch."""
    main = ce_chunks.main_cols(V)
    out = torch.zeros(V, dtype=F32, device=weight.device)
    if main and dl_last.dim() == 2 and dl_last.shape[0]:
        m = dl_last.shape[0]
        epi = weighted_colsum_epilogue(dl_last.dtype)
        tensors = {UNSCALED: dl_last, ROW_SCALE: weight}
        out[:main] = run_map(epi, m, main, dl_last, **tensors)[WEIGHTED_COLSUM][:main]
    if V - main and dl_tail.dim() == 2:
        out[main:] = (dl_tail * weight[:, None]).sum(0)
    return out


lce_weighted_colsum = custom_op(
    "coda::lce_weighted_colsum", _lce_weighted_colsum_impl, mutates_args=()
)
_lce_weighted_colsum = EagerOp(lce_weighted_colsum, _lce_weighted_colsum_impl)


@lce_weighted_colsum.register_fake
def _(dl_last, dl_tail, weight, V):
    return weight.new_empty((V,), dtype=F32)


_fused_backward = register_formula("coda::lce_fused_loss", _fused_backward, _fused_setup)

#: ``coda::lce_fused_loss(*args)`` (every argument positional, defaults included) with
#: autograd: in plain eager calls its implementation and formula without the dispatcher
#: (``_dispatch.EagerOp``: through the custom op the call cost 1.65 ms of host time at
#: M = 256 where its implementation took 1.12, on the H200 machine), else the custom op
#: (compilers, fake tensors, subclasses, modes)
fused_loss = EagerOp(lce_fused_loss, _fused_loss, _fused_setup, _fused_backward)
#: ``coda::lce_fused_finish``, likewise (no formula: it runs inside the loss's backward on
#: detached tensors)
_finish = EagerOp(lce_fused_finish, _fused_finish)
