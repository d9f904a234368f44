"""coda.fusions.ce_epilogues: the epilogues of the LM-head cross-entropy (fwd and bwd).

Sits under ``coda.fusions.cross_entropy`` (the recompute path) and ``coda.fusions.ce_fused``
(the gradient-in-forward path), above the primitives. The epilogues run after the logits
GEMM ``acc = h @ W_c.T`` of one vocabulary chunk (W_c: rows [v0, v1) of the LM head), or,
for ``grad_map_epilogue``, on an acc stored earlier, and compute the logits on the fly:

    s = rstd * acc + bias          (rstd: a per-row scale, the deferred final RMSNorm)
    z = cap * tanh(s / cap)        (softcap, Gemma 2; z = s without it)

**Forward** (``stats_epilogue``): per row, over the chunk's columns, the three logit
statistics every loss option is built from, nothing M x V written:

* ``lse``: log sum_j exp(z_j)              (``LogSumExp``, online max / sum-exp)
* ``zt``:  z[target] (0 when the target is not in this chunk)       (``TargetSelect``)
* ``zsum``: sum_j z_j (label smoothing only)                          (``TileReduce``)
* ``ent``: the entropy of the chunk's softmax (``return_entropy`` only)  (``SoftmaxEntropy``:
  online, relative to the running max, which then gives lse too in place of ``LogSumExp``;
  chunks merged by ``cross_entropy``)

**Backward** (``grad_epilogue``): given per-row upstream gradients of the three
statistics (``ga`` for lse, ``gt`` for zt, ``gs`` for zsum) and the saved full-vocabulary
lse, the gradient with respect to z is

    g = ga * exp(z - lse) + gt * onehot(target) + gs           (``OneHot``: a new primitive)

plus, with an entropy gradient ``ge``, ge * dH/dz = -ge p (z - E_p[z]) = -ge p ((z - lse) +
ent) (row vector ``ent``: the forward's entropy), then the softcap chain
g *= 1 - (z / cap)^2 gives dL/ds; dL/drstd = sum_j g acc (row
``TileReduce``), dL/dbias = sum_i g (column ``TileReduce``), and the stored chunk
``dlogits = rstd * g`` (= dL/dacc) feeds the dh and dW GEMMs.

**Gradient-in-forward** (``ce_fused``): ``stats_store_epilogue`` is the forward plus a
``TileStore`` of acc (``STORED_ACC``, rounded to the store dtype first by ``RoundTo`` so
that the statistics are those of exactly the stored values); ``grad_map_epilogue`` is the
backward chain without a GEMM (``run_map``): a ``TileLoad`` of the stored acc in place of
``acc`` (``_logits`` and ``_grad`` take the source value's name), drstd summing g times
that loaded acc. ``scaled_total_epilogue`` is the backward's last row chunk: its dh and
dW GEMMs scale acc (plus, for dW over several row chunks, the fp32 sum of the earlier
chunks, a ``TileLoad`` of ``PARTIAL_SUM``) by the loss's upstream gradient and store the
total rounded once to the gradient's dtype.

**Shifted softmax** (``ce_fused``'s default where the options allow: no bias, softcap or
label smoothing): ``shifted_store_epilogue`` stores, in place of the logits, their
exponentials against a per-row shift c known before the GEMM (``SHIFT``: the target's
logit plus a margin, from a dot product per row),

    R = exp(min(z - c, ``SHIFT_CLAMP``))                          (``SHIFTED``)

beside the exact lse and zt of z. The softmax exp(z - lse) = R * exp(c - lse) is then R
times a per-row factor, so the gradient's M x V pass over the stored logits disappears:
the dh GEMM scales its rows in its epilogue and the dW GEMM's other operand carries the
factor (``ce_fused``). ``shifted_map_epilogue`` is the same over a stored acc (``run_map``,
written in place).

**The padded tail** (recompute path; the gradient-in-forward path computes the V mod 8
tail columns in torch). TMA moves M x N tiles in rows of 16 bytes, so every chunk is a
multiple of 8 columns; the last V mod 8 columns run as an 8-column chunk over a
zero-padded copy of their weight rows. Their acc is exactly 0, so z = softcap(bias_pad =
0) = 0 there: the forward masks them to -inf for the log-sum-exp with a 0/1 column vector
``valid`` (``masked=True``) and z = 0 adds nothing to the sum; the backward needs no mask,
since the padded columns of dlogits meet zero weight rows in dh, acc = 0 in drstd, and
their dW and dbias entries are dropped.

Every ``fn`` is a module-level function or an attrs value (equal across calls), so equal
options give equal epilogues and one compiled kernel each.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from coda.epilogue import Epilogue
from coda.primitives import (
    Elementwise,
    LogSumExp,
    OneHot,
    SoftmaxEntropy,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
)
from coda.primitives import math as cm

__all__ = [
    "GRAD_SCALE",
    "PARTIAL_SUM",
    "RANK_COL",
    "RANK_ROW",
    "ROW_SCALE",
    "SCALED",
    "SHIFT",
    "SHIFTED",
    "SHIFT_CLAMP",
    "STORED_ACC",
    "TOTAL",
    "UNSCALED",
    "WEIGHTED_COLSUM",
    "RoundTo",
    "Softcap",
    "SoftcapGrad",
    "scaled_total_epilogue",
    "grad_epilogue",
    "row_scaled_epilogue",
    "grad_map_epilogue",
    "shifted_exp",
    "shifted_map_epilogue",
    "shifted_store_epilogue",
    "stats_epilogue",
    "stats_map_epilogue",
    "stats_store_epilogue",
    "weighted_colsum_epilogue",
]

F32 = torch.float32
#: dtype of the chunk-local targets the ops pass (-1: no target in this chunk)
TARGET_DTYPE = torch.int32
#: name of the GEMM result stored by ``stats_store_epilogue`` and loaded by ``grad_map_epilogue``
STORED_ACC = "stored_acc"
#: name of the fp32 partial sum that ``scaled_total_epilogue`` adds to acc (an input)
PARTIAL_SUM = "partial_sum"
#: name of ``scaled_total_epilogue``'s fp32 column vector: the loss's upstream gradient
GRAD_SCALE = "grad_scale"
#: name of ``scaled_total_epilogue``'s output: (acc + partial sum) * scale, output dtype
TOTAL = "total"
#: name of ``scaled_total_epilogue``'s optional fp32 row vector scaling acc
ROW_SCALE = "row_scale"
#: names of ``scaled_total_epilogue``'s optional rank-1 term: fp32 row and column vectors
RANK_ROW, RANK_COL = "rank_row", "rank_col"
#: names of ``row_scaled_epilogue``'s M x N input and output
UNSCALED, SCALED = "unscaled_rows", "scaled_rows"
#: output of ``weighted_colsum_epilogue``: sum_rows ROW_SCALE * UNSCALED per column
WEIGHTED_COLSUM = "weighted_colsum"
#: name of the per-row shift c (fp32) of ``shifted_store_epilogue``
SHIFT = "shift"
#: name of the stored exp(min(z - c, SHIFT_CLAMP))
SHIFTED = "shifted"
#: largest exponent of R: exp(64) * V * |W| stays far inside fp32 in the GEMMs that read R
SHIFT_CLAMP = 64.0


@attrs.frozen
class Softcap:
    """z = cap * tanh(s / cap)."""

    cap: float = attrs.field(converter=float)
    __name__ = "softcap"

    def __call__(self, s: Any) -> Any:
        return self.cap * cm.tanh(s * (1.0 / self.cap))


@attrs.frozen
class SoftcapGrad:
    """dL/ds = dL/dz * (1 - tanh^2(s / cap)) = g * (1 - (z / cap)^2)."""

    cap: float = attrs.field(converter=float)
    __name__ = "softcap_grad"

    def __call__(self, g: Any, z: Any) -> Any:
        u = z * (1.0 / self.cap)
        return g - g * (u * u)


@attrs.frozen
class RoundTo:
    """x rounded to ``dtype`` and back (``cm.round_to``): the value a store + load gives."""

    dtype: torch.dtype
    __name__ = "round_to"

    def __call__(self, x: Any) -> Any:
        return cm.round_to(x, self.dtype)


def scale_shift(acc: Any, rstd: Any, bias: Any) -> Any:
    """rstd * acc + bias."""
    return acc * rstd + bias


def mask_neg_inf(z: Any, valid: Any) -> Any:
    """z where the column is valid, -inf in the padded columns of the tail chunk."""
    return cm.where(valid > 0.5, z, float("-inf"))


def ce_grad(z: Any, lse: Any, ga: Any, gt: Any, hit: Any) -> Any:
    """ga * softmax(z) + gt * onehot: the gradient of (lse, z[target]) weighted per row."""
    return ga * cm.exp_diff(z, lse) + gt * hit


def ce_grad_sum(z: Any, lse: Any, ga: Any, gt: Any, hit: Any, gs: Any) -> Any:
    """``ce_grad`` plus gs * 1: the gradient of the row sum of z (label smoothing)."""
    return ga * cm.exp_diff(z, lse) + gt * hit + gs


def ce_grad_ent(z: Any, lse: Any, ga: Any, gt: Any, hit: Any, ge: Any, ent: Any) -> Any:
    """``ce_grad`` plus the entropy's gradient -ge softmax(z) (z - E_p[z]), with z - E_p[z]
    = (z - lse) + ent (the log-probability, as eager's log_softmax takes it, plus the
    row's entropy: no term of the logits' size cancels)."""
    return (ga - ge * ((z - lse) + ent)) * cm.exp_diff(z, lse) + gt * hit


def ce_grad_sum_ent(
    z: Any, lse: Any, ga: Any, gt: Any, hit: Any, gs: Any, ge: Any, ent: Any
) -> Any:
    """``ce_grad_ent`` plus gs * 1 (label smoothing)."""
    return (ga - ge * ((z - lse) + ent)) * cm.exp_diff(z, lse) + gt * hit + gs


def _logits(
    bias_dtype: torch.dtype | None, rstd: bool, softcap: float | None, src: str = "acc"
) -> tuple[list, str]:
    """The primitives computing z from the GEMM result ``src`` (``acc``, or the stored
    acc that the gradient-in-forward path loads back), and the name of z."""
    prims: list = []
    name = src
    if rstd:
        prims.append(VecLoad("rstd", per="row", dtype=F32))
    if bias_dtype is not None:
        prims.append(VecLoad("bias", per="col", dtype=bias_dtype))
    if rstd and bias_dtype is not None:
        prims.append(Elementwise("s", scale_shift, ins=(src, "rstd", "bias")))
        name = "s"
    elif rstd:
        prims.append(Elementwise("s", ops.mul, ins=(src, "rstd")))
        name = "s"
    elif bias_dtype is not None:
        prims.append(Elementwise("s", ops.add, ins=(src, "bias")))
        name = "s"
    if softcap is not None:
        prims.append(Elementwise("z", Softcap(softcap), ins=(name,)))
        name = "z"
    return prims, name


def _stats(
    bias_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    masked: bool,
    src: str = "acc",
    entropy: bool = False,
) -> list:
    """The forward chain: z from ``src``, then lse, zt (and zsum; and with ``entropy``
    ent) of its columns."""
    prims, z = _logits(bias_dtype, rstd, softcap, src)
    lse_of = z
    if masked:
        prims.append(VecLoad("valid", per="col", dtype=F32))
        prims.append(Elementwise("z_lse", mask_neg_inf, ins=(z, "valid")))
        lse_of = "z_lse"
    prims.append(_lse(lse_of, entropy))  # -inf columns: p = 0 in the entropy
    prims.append(
        TargetSelect("zt", of=z, target="tloc", ignore_index=-1, target_dtype=TARGET_DTYPE)
    )
    if with_sum:
        prims.append(TileReduce("zsum", of=z, op="sum"))
    return prims


def _grad(
    prims: list,
    z: str,
    src: str,
    out_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    dbias: bool,
    drstd: bool,
    entropy: bool = False,
) -> Epilogue:
    """The backward chain after ``prims`` (which define z, named ``z``, from ``src``):
    g = dL/dz from the row gradients (with ``entropy`` the entropy's too: row vectors
    ``ge`` and ``ent``), the softcap chain, the drstd / dbias reductions and the stored dlogits =
    rstd * g."""
    prims = list(prims)
    prims += [VecLoad(n, per="row", dtype=F32) for n in ("lse", "ga", "gt")]
    prims.append(OneHot("hit", target="tloc", target_dtype=TARGET_DTYPE))
    ins = (z, "lse", "ga", "gt", "hit")
    if with_sum:
        prims.append(VecLoad("gs", per="row", dtype=F32))
        ins += ("gs",)
    if entropy:
        prims += [VecLoad(n, per="row", dtype=F32) for n in ("ge", "ent")]
        ins += ("ge", "ent")
    fn = {
        (False, False): ce_grad,
        (True, False): ce_grad_sum,
        (False, True): ce_grad_ent,
        (True, True): ce_grad_sum_ent,
    }[with_sum, entropy]
    prims.append(Elementwise("g0", fn, ins=ins))
    g = "g0"
    if softcap is not None:
        prims.append(Elementwise("g2", SoftcapGrad(softcap), ins=(g, z)))
        g = "g2"
    if drstd:
        prims.append(Elementwise("g_acc", ops.mul, ins=(g, src)))
        prims.append(TileReduce("drstd", of="g_acc", op="sum"))
    if dbias:
        prims.append(TileReduce("dbias", of=g, op="sum", per="col"))
    if out_dtype is not None:
        if rstd:
            prims.append(Elementwise("dl", ops.mul, ins=(g, "rstd")))
            g = "dl"
        prims.append(TileStore(g, out_dtype, name="dlogits"))
    return Epilogue(prims)


def shifted_exp(z: Any, c: Any) -> Any:
    """exp(min(z - c, SHIFT_CLAMP)): the softmax numerator against the row shift c."""
    return cm.exp_fast(cm.minimum(z - c, SHIFT_CLAMP))


def _lse(of: str, entropy: bool) -> Any:
    """The row log-sum-exp of ``of`` as ``lse``: ``LogSumExp``, or with ``entropy`` a
    ``SoftmaxEntropy`` (``ent``) that gives lse from its own running max and sum."""
    return SoftmaxEntropy("ent", of=of, lse="lse") if entropy else LogSumExp("lse", of=of)


def _shifted(
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    out_dtype: torch.dtype,
    src: str,
    entropy: bool = False,
) -> list:
    """z from ``src``, its exact lse and zt (with ``with_sum``: zsum; with ``entropy``:
    the softmax's entropy ``ent``), and R = ``shifted_exp(z, SHIFT)`` stored as
    ``SHIFTED`` (with ``softcap``: times dz/ds = 1 - (z / cap)^2, the chain to the
    pre-cap logits)."""
    prims, z = _logits(None, rstd, softcap, src)
    prims.append(_lse(z, entropy))
    prims.append(
        TargetSelect("zt", of=z, target="tloc", ignore_index=-1, target_dtype=TARGET_DTYPE)
    )
    if with_sum:
        prims.append(TileReduce("zsum", of=z, op="sum"))
    prims.append(VecLoad(SHIFT, per="row", dtype=F32))
    prims.append(Elementwise("r", shifted_exp, ins=(z, SHIFT)))
    r = "r"
    if softcap is not None:
        prims.append(Elementwise("r_s", SoftcapGrad(softcap), ins=("r", z)))
        r = "r_s"
    prims.append(TileStore(r, out_dtype, name=SHIFTED))
    return prims


@functools.cache
def shifted_store_epilogue(
    out_dtype: torch.dtype,
    rstd: bool,
    softcap: float | None = None,
    with_sum: bool = False,
    entropy: bool = False,
) -> Epilogue:
    """The shifted-softmax forward after the logits GEMM (see the module doc): outputs
    ``lse`` and ``zt`` of z = [softcap of] (rstd *) acc, exact from the fp32 acc; stores
    ``SHIFTED`` = exp(min(z - c, ``SHIFT_CLAMP``)) [* (1 - (z / cap)^2)] in
    ``out_dtype`` (with ``with_sum`` also ``zsum``, for label smoothing; with ``entropy``
    ``ent``, the entropy of softmax(z)). Inputs ``tloc``, ``SHIFT`` (fp32 per row) and,
    with ``rstd``, ``rstd``."""
    return Epilogue(_shifted(rstd, softcap, with_sum, out_dtype, "acc", entropy))


@functools.cache
def shifted_map_epilogue(
    acc_dtype: torch.dtype,
    out_dtype: torch.dtype,
    rstd: bool,
    softcap: float | None = None,
    with_sum: bool = False,
    entropy: bool = False,
) -> Epilogue:
    """``shifted_store_epilogue`` without a GEMM (``run_map``) over the acc a plain GEMM
    stored (``STORED_ACC``, ``acc_dtype``): the statistics of exactly those stored values
    and R written over them in place when the dtypes agree. Reads no ``acc``."""
    prims = _shifted(rstd, softcap, with_sum, out_dtype, STORED_ACC, entropy)
    return Epilogue([TileLoad(STORED_ACC, acc_dtype), *prims])


@functools.cache
def stats_epilogue(
    bias_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    masked: bool,
    entropy: bool = False,
) -> Epilogue:
    """Outputs ``lse``, ``zt`` (and ``zsum``; with ``entropy`` ``ent``) of one chunk;
    inputs ``tloc`` (int32 chunk-local targets, -1 for none) and, as enabled, ``rstd``,
    ``bias``, ``valid``."""
    return Epilogue(_stats(bias_dtype, rstd, softcap, with_sum, masked, entropy=entropy))


@functools.cache
def stats_store_epilogue(
    store_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    entropy: bool = False,
) -> Epilogue:
    """``stats_epilogue`` (unmasked: the gradient-in-forward path runs only whole 8-column
    groups through the GEMM) plus the GEMM result itself, stored as ``STORED_ACC`` in
    ``store_dtype`` for ``grad_map_epilogue``. Below fp32 the statistics are taken from
    acc rounded to ``store_dtype`` (``RoundTo``, exactly the stored value), so the lse
    the gradient's softmax divides by is that of the logits it is computed from."""
    prims: list = []
    src = "acc"
    if store_dtype != F32:
        prims.append(Elementwise("acc_r", RoundTo(store_dtype), ins=("acc",)))
        src = "acc_r"
    prims += _stats(bias_dtype, rstd, softcap, with_sum, masked=False, src=src, entropy=entropy)
    prims.append(TileStore(src, store_dtype, name=STORED_ACC))
    return Epilogue(prims)


@functools.cache
def stats_map_epilogue(
    acc_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    entropy: bool = False,
) -> Epilogue:
    """``stats_store_epilogue``'s statistics without a GEMM (``run_map``): taken from the
    acc a plain GEMM stored, loaded back as ``STORED_ACC`` (``acc_dtype``), so the same
    values as the fused epilogue's (which rounds acc to the stored dtype first). Reads no
    ``acc``; stores nothing M x N."""
    prims: list = [TileLoad(STORED_ACC, acc_dtype)]
    prims += _stats(
        bias_dtype, rstd, softcap, with_sum, masked=False, src=STORED_ACC, entropy=entropy
    )
    return Epilogue(prims)


@functools.cache
def grad_epilogue(
    out_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    dbias: bool,
    drstd: bool,
    entropy: bool = False,
) -> Epilogue:
    """Stores ``dlogits`` (= dL/dacc, in ``out_dtype``; not stored when None) and, as
    asked, outputs ``dbias`` (col) and ``drstd`` (row) of one chunk. Inputs: ``tloc``,
    ``lse``, ``ga``, ``gt`` (and ``gs``; with ``entropy`` ``ge`` and ``mu``) plus those of
    the forward."""
    prims, z = _logits(bias_dtype, rstd, softcap)
    return _grad(prims, z, "acc", out_dtype, rstd, softcap, with_sum, dbias, drstd, entropy)


@functools.cache
def grad_map_epilogue(
    acc_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    rstd: bool,
    softcap: float | None,
    with_sum: bool,
    dbias: bool,
    drstd: bool,
) -> Epilogue:
    """``grad_epilogue`` without a GEMM (``run_map``): the same chain on the acc that
    ``stats_store_epilogue`` stored, loaded back as ``STORED_ACC`` (``acc_dtype``); drstd
    sums g times that loaded acc. Reads no ``acc``."""
    prims, z = _logits(bias_dtype, rstd, softcap, src=STORED_ACC)
    prims.insert(0, TileLoad(STORED_ACC, acc_dtype))
    return _grad(prims, z, STORED_ACC, out_dtype, rstd, softcap, with_sum, dbias, drstd)


def add_outer(x: Any, a: Any, b: Any) -> Any:
    """x + a * b (a row vector times a column vector: a rank-1 term)."""
    return x + a * b


@functools.cache
def scaled_total_epilogue(
    out_dtype: torch.dtype, partial: bool, row_scale: bool = False, rank1: bool = False
) -> Epilogue:
    """``TOTAL`` = ``GRAD_SCALE`` * ([``ROW_SCALE`` *] acc [+ ``PARTIAL_SUM``, an fp32
    M x N input]), rounded once to ``out_dtype``; ``GRAD_SCALE`` is an fp32 column vector
    (the loss's upstream gradient, broadcast), ``ROW_SCALE`` an fp32 row vector (the
    shifted softmax's per-row factor). The backward GEMMs of the gradient-in-forward
    path's last row chunk: dh of its rows (``PARTIAL_SUM``: the V mod 8 tail's fp32
    product) and dW (``PARTIAL_SUM``: the earlier chunks' fp32 sum), written scaled and
    in their dtypes, with no cast or scaling pass; with ``row_scale`` also the shifted
    path's dh of every row chunk; ``rank1`` adds ``RANK_ROW`` (fp32 per row) times
    ``RANK_COL`` (fp32 per column) after the row scale (the shifted path's label
    smoothing: gs x colsum(W) in dh, 1 x sum_m gs h in dW)."""
    prims: list = [VecLoad(GRAD_SCALE, per="col", dtype=F32)]
    src = "acc"
    if row_scale:
        prims += [
            VecLoad(ROW_SCALE, per="row", dtype=F32),
            Elementwise("row_scaled", ops.mul, ins=("acc", ROW_SCALE)),
        ]
        src = "row_scaled"
    if rank1:
        prims += [
            VecLoad(RANK_ROW, per="row", dtype=F32),
            VecLoad(RANK_COL, per="col", dtype=F32),
            Elementwise("with_rank1", add_outer, ins=(src, RANK_ROW, RANK_COL)),
        ]
        src = "with_rank1"
    if partial:
        prims += [
            TileLoad(PARTIAL_SUM, F32),
            Elementwise("unscaled", ops.add, ins=(src, PARTIAL_SUM)),
        ]
        src = "unscaled"
    prims += [
        Elementwise(TOTAL, ops.mul, ins=(src, GRAD_SCALE)),
        TileStore(TOTAL, out_dtype),
    ]
    return Epilogue(tuple(prims))


@functools.cache
def row_scaled_epilogue(dtype: torch.dtype) -> Epilogue:
    """``SCALED`` = ``ROW_SCALE`` * ``UNSCALED`` per row, computed in fp32 and rounded once
    to ``dtype`` (the M x N input's): a map pass (``run_map``, reads no acc) making the
    shifted path's dW operand s * h in one read and one write, where torch's mixed-dtype
    product takes an fp32 temporary and a cast."""
    return Epilogue(
        (
            TileLoad(UNSCALED, dtype),
            VecLoad(ROW_SCALE, per="row", dtype=F32),
            Elementwise("row_scaled", ops.mul, ins=(UNSCALED, ROW_SCALE)),
            TileStore("row_scaled", dtype, name=SCALED),
        )
    )


@functools.cache
def weighted_colsum_epilogue(dtype: torch.dtype) -> Epilogue:
    """``WEIGHTED_COLSUM`` = sum over rows of ``ROW_SCALE`` * ``UNSCALED`` per column, in
    fp32 (column partials per row tile, finalized): a map pass (``run_map``) over an
    M x N tensor of ``dtype``. Per-row losses' dbias = dlogits.T @ (g / rstd): the stored
    dlogits weighted by the backward's per-row upstream gradient."""
    return Epilogue(
        (
            TileLoad(UNSCALED, dtype),
            VecLoad(ROW_SCALE, per="row", dtype=F32),
            Elementwise("weighted_rows", ops.mul, ins=(UNSCALED, ROW_SCALE)),
            TileReduce(WEIGHTED_COLSUM, of="weighted_rows", op="sum", per="col"),
        )
    )
