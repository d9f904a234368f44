"""coda.primitives.state: ``StateTransition``, running per-row states across a tile.

A state transition keeps, for every row of a tile, a small running state that each
subtile updates as the visitor walks the tile left to right; at the end of the tile the
state is written as per-tile partials (M, n_tiles_n), and ``finalize`` merges the tiles.
Both kinds below reduce over the columns of a tile value (width w, C = N * w columns),
one result per row (per="row" only: the state lives in the rows a thread owns).

* ``LogSumExp(name, of)``: the online softmax normalizer. State per row: (m, s), the running
  max and the sum of exp(v - m). A subtile with block max b updates
  ``m' = max(m, b)``, ``s' = s * exp(m - m') + sum(exp(v - m'))``. Partials:
  ``{name}.partials_max`` and ``{name}.partials_sumexp``. Finalize:
  ``lse = M + log(sum_j s_j exp(m_j - M))`` with ``M = max_j m_j``; equals
  ``torch.logsumexp(v, dim=1)``. Out-of-bounds columns are -inf and contribute nothing.
* ``SoftmaxEntropy(name, of)``: the entropy -sum_j p_j log p_j of the row's softmax,
  p = softmax(v) (over the columns of ``of`` this epilogue sees). State per row: (m, s, t),
  the running max, the sum of exp(v - m) and the sum of exp(v - m) (v - m); a new max m'
  rescales them as ``s' = s e^(m - m')`` and ``t' = (t + (m - m') s) e^(m - m')``. Then
  E_p[v] - m = t / s and the entropy is ``log s - t / s``: every quantity is relative to
  the row's max, so nothing of the size of the logits cancels (lse - E_p[v] would lose
  ulp(lse)). Partials: ``{name}.partials_max``, ``.partials_sumexp``, ``.partials_wsum``.
  Merging entropies of disjoint column sets: H = sum_c w_c (H_c + lse - lse_c), w_c =
  exp(lse_c - lse) (``coda.fusions.cross_entropy`` does so across vocabulary chunks).
* ``TargetSelect(name, of, target="target", ignore_index=-100)``: picks
  ``v[m, target[m]]`` for an integer row vector ``target`` (M,). The partial of tile j is
  the value when ``target[m]`` falls in that tile's columns, else 0; finalize sums the
  partials over tiles. Rows whose target equals ``ignore_index`` give 0; any other target
  outside [0, C) is an InputError.

With both, the cross-entropy loss is ``lse - picked`` and the M x C logits are never written.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch

from coda.errors import InputError, KindError
from coda.geometry import Problem, ceil_div
from coda.primitives._validators import index_dtype, integer, new_name, read_name
from coda.primitives.base import Primitive
from coda.primitives.context import ReferenceEnv, Subtile, Tile
from coda.specs import TensorSpec, ValueSpec

__all__ = ["LogSumExp", "SoftmaxEntropy", "StateTransition", "TargetSelect"]

NEG_INF = float("-inf")


@attrs.frozen
class StateTransition(Primitive):
    """Base of per-row running states over the columns of tile value ``of``; the result,
    output ``name`` (M,), exists only after the last tile (it is not a value)."""

    name: str = attrs.field(validator=new_name)
    of: str = attrs.field(validator=read_name)

    per = "row"

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.of,)

    @property
    def writes(self) -> tuple[str, ...]:
        return ()

    @property
    def label(self) -> str:
        return f"{type(self).__name__}({self.name!r} of {self.of!r})"

    def infer(self, values: Mapping[str, ValueSpec]) -> tuple[ValueSpec, ...]:
        spec = values[self.of]
        if spec.kind != "tile":
            raise KindError(
                f"{self.label}: {self.of!r} is a {spec.describe()}; state transitions run "
                "over the columns of a tile value"
            )
        return ()

    @property
    @abc.abstractmethod
    def partial_names(self) -> tuple[str, ...]:
        """Names of the per-tile partial outputs, each (M, n_tiles_n) fp32."""

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        out = [TensorSpec(self.name, "row", torch.float32, direction="out")]
        out += [
            TensorSpec(p, "partials_row", torch.float32, direction="out")
            for p in self.partial_names
        ]
        return tuple(out)


def _padded_blocks(env: ReferenceEnv, v: torch.Tensor, of: str) -> torch.Tensor:
    """``v`` (M, C) cut into its tiles' column blocks, (M, tiles, tile columns), the
    columns past C filled with -inf (what a tile's masked edge sees)."""
    M, C = v.shape
    tc = int(env.tile[1] * env.specs[of].width)
    nt = ceil_div(env.problem.N, env.tile[1])
    padded = torch.full((M, nt * tc), NEG_INF, dtype=v.dtype, device=v.device)
    padded[:, :C] = v
    return padded.reshape(M, nt, tc)


def _lse_of(pm: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """Per row: the log-sum-exp from tiles' (max, sum of exp(v - max)), (rows, tiles)."""
    top = pm.amax(1, keepdim=True)
    shift = torch.where(top == NEG_INF, torch.zeros_like(top), top)
    return shift[:, 0] + torch.log((ps * torch.exp(pm - shift)).sum(1))


@attrs.frozen
class _OnlineSoftmaxState(StateTransition):
    """What ``LogSumExp`` and ``SoftmaxEntropy`` share: a running max per row over the
    columns of ``of`` (-inf past N), and running sums relative to it kept in
    ``BandRows`` of ``len(STATE_IDENTITY)`` values, written as the tile's partials."""

    #: the running state's identity (max first), one value per partial
    STATE_IDENTITY: ClassVar[tuple[float, ...]] = ()
    #: the simulator's names of those values, in the same order ("m": the running max)
    STATE_KEYS: ClassVar[str] = ""

    def trace_begin_tile(self, tile: Any) -> dict:
        return {}

    def begin_tile(self, tile: Tile) -> dict[str, torch.Tensor]:
        pairs = zip(self.STATE_KEYS, self.STATE_IDENTITY, strict=True)
        return {key: tile.full_rows(x) for key, x in pairs}

    def end_tile(self, tile: Tile, state: dict[str, torch.Tensor]) -> None:
        for name, key in zip(self.partial_names, self.STATE_KEYS, strict=True):
            tile.write_row_partial(name, state[key])

    def _visited(self, sub: Subtile) -> tuple[torch.Tensor, Any]:
        """(the subtile's values of ``of``, -inf past the edges; its tile-local rows)."""
        v = sub.values[self.of]
        v = torch.where(sub.mask(sub.specs[self.of].width), v, torch.full_like(v, NEG_INF))
        return v, sub.local_rows()

    def masks_edges(self, zero_outside: frozenset[str]) -> bool:
        return True  # the columns past N must not count: -inf there, whatever the value

    def _masked_row_max(self, ctx: Any, values: dict[str, Any]) -> tuple[Any, Any, dict]:
        """(view of ``of``, its fragment with -inf past the edges, per row offset: the
        subtile's row max)."""
        from coda.primitives import tracing

        v = ctx.view_of(self.of)
        x = tracing.masked(
            values[self.of],
            v.layout,
            v.coords,
            v.shape_mn,
            float("-inf"),
            rows=False,
            interior=ctx.tile.interior,
        )
        return v, x, tracing.row_reduce("max", x, v.frag)

    def _rows(self, ctx: Any, state: dict, sub_max: dict):
        """Per row offset r of the subtile: (the band's state, r, r's state so far or None,
        the new running max, that max or 0 where it is -inf: the exponents' base)."""
        from coda.primitives import tracing

        band = state[ctx.subtile[0]]
        for r, smax in sub_max.items():
            old = band.old(ctx, r)
            new_m = smax if old is None else tracing.fr.combine("max", old[0], smax)
            yield band, r, old, new_m, tracing.finite_or_zero(new_m)

    rollable = True

    def trace_begin_band(self, ctx: Any, state: dict, rolled: bool) -> None:
        from coda.primitives import tracing

        rows = ctx.view_of(self.of).frag.rows
        identity = self.STATE_IDENTITY if rolled else None
        state[ctx.subtile[0]] = tracing.BandRows(rows, len(self.STATE_IDENTITY), identity)

    def trace_end_band(self, ctx: Any, state: dict) -> None:
        from coda.primitives import tracing

        tracing.write_band(ctx, state[ctx.subtile[0]], self.partial_names)


#: ``LogSumExp``'s running-sum rescale uses ``exp_diff`` when a thread holds at most this
#: many elements of a row per subtile (32-column subtiles: 8), libdevice's ``exp`` for
#: more (64-column subtiles: 16). Chosen by the sm_90a register allocation of the
#: 128 x 128 PingPong kernels: each other combination spilled 1-4 registers.
LSE_FAST_RESCALE_TERMS = 8


@attrs.frozen
class LogSumExp(_OnlineSoftmaxState):
    """Online log-sum-exp per row of tile value ``of`` -> output ``name`` (M,)."""

    STATE_IDENTITY: ClassVar[tuple[float, ...]] = (NEG_INF, 0.0)  # (max, sum of exp(v - max))
    STATE_KEYS: ClassVar[str] = "ms"

    @property
    def partial_names(self) -> tuple[str, str]:
        return (f"{self.name}.partials_max", f"{self.name}.partials_sumexp")

    def reference(self, env: ReferenceEnv) -> None:
        v = env.values[self.of]
        env.outputs[self.name] = torch.logsumexp(v, dim=1)
        if env.tile is None:
            return
        blocks = _padded_blocks(env, v, self.of)
        pm = blocks.amax(2)
        pmax, psum = self.partial_names
        env.outputs[pmax] = pm
        env.outputs[psum] = torch.exp(blocks - pm[:, :, None]).sum(2)

    def visit(self, sub: Subtile, state: dict[str, torch.Tensor]) -> None:
        v, rows = self._visited(sub)
        m_old, s_old = state["m"][rows], state["s"][rows]
        m_new = torch.maximum(m_old, v.amax(1))
        # rows with no finite element yet keep m = -inf; shift by 0 there to avoid inf - inf
        shift = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
        s_new = s_old * torch.exp(m_old - shift) + torch.exp(v - shift[:, None]).sum(1)
        state["m"][rows], state["s"][rows] = m_new, s_new

    def finalize(
        self,
        partials: Mapping[str, torch.Tensor],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> dict[str, torch.Tensor]:
        pmax, psum = self.partial_names
        return {self.name: _lse_of(partials[pmax], partials[psum])}

    traces_finalize = True

    def trace_finalize(self, fin: Any) -> None:
        from coda.primitives import tracing

        pmax, psum = (fin.tensor(n) for n in self.partial_names)
        tracing.finalize_logsumexp(pmax, psum, fin.tensor(self.name), fin.row, fin.lane, fin.lanes)

    def trace(self, ctx: Any, values: dict[str, Any], state: dict) -> None:
        from coda.primitives import math as cm
        from coda.primitives import tracing

        v, x, sub_max = self._masked_row_max(ctx, values)
        for band, r, old, new_m, base in self._rows(ctx, state, sub_max):
            members = v.frag.row_members(r)
            # every term is exp(v - max) <= 1: the two-instruction exp_diff (ex2.approx
            # of one FMA) is accurate to ~2 ulp + |v - max| 2^-24 there
            total = tracing.sum_terms(cm.exp_diff(x[i], base) for i in members)
            total = tracing.fr.quad_allreduce("sum", total)
            if old is not None:
                # the running sum's rescale, once per row: exp_diff too for a 32-column
                # subtile's 8 terms a row, libdevice's exp for more (which register
                # allocation leaves spill-free in both cases: LSE_FAST_RESCALE_TERMS)
                if len(members) <= LSE_FAST_RESCALE_TERMS:
                    total = total + old[1] * cm.exp_diff(old[0], base)
                else:
                    total = total + old[1] * cm.exp(old[0] - base)
            band.put(r, (new_m, total))


#: ``SoftmaxEntropy``: v - m is floored here before it multiplies exp(v - m), so that a
#: -inf (masked) element adds 0 * (-1e4) = 0, not 0 * -inf = NaN (exp(-1e4) is 0 in fp32)
ENTROPY_FLOOR = -1.0e4


def _entropy_terms(v: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums of exp(v - base) and of exp(v - base) (v - base), ``base`` (rows,) finite."""
    d = torch.clamp(v - base[:, None], min=ENTROPY_FLOOR)
    e = torch.exp(d)
    return e.sum(1), (e * d).sum(1)


def _entropy_of(m: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per row: the entropy log s - t / s from (max, sum, weighted sum) merged over the
    last dim (partials of tiles: (rows, tiles)); 0 for a row with no element."""
    top = m.amax(1, keepdim=True)
    shift = torch.where(top == NEG_INF, torch.zeros_like(top), top)
    finite = torch.where(m == NEG_INF, shift, m)
    f = torch.exp(m - shift)
    S = (s * f).sum(1)
    T = ((t + (finite - shift) * s) * f).sum(1)
    safe = torch.where(S > 0, S, torch.ones_like(S))
    return torch.where(S > 0, torch.log(safe) - T / safe, torch.zeros_like(S))


def _optional_new_name(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        new_name(inst, attribute, value)


@attrs.frozen
class SoftmaxEntropy(_OnlineSoftmaxState):
    """Online entropy of each row's softmax of tile value ``of`` -> output ``name`` (M,);
    with ``lse`` the row's log-sum-exp too, output ``lse`` (M,), from the same state (a
    LogSumExp beside it would keep a second running max and sum)."""

    lse: str | None = attrs.field(default=None, validator=_optional_new_name)
    # (max, sum of exp(v - max), sum of exp(v - max) (v - max))
    STATE_IDENTITY: ClassVar[tuple[float, ...]] = (NEG_INF, 0.0, 0.0)
    STATE_KEYS: ClassVar[str] = "mst"

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        out = super().tensors(values)
        if self.lse is None:
            return out
        return out + (TensorSpec(self.lse, "row", torch.float32, direction="out"),)

    @property
    def partial_names(self) -> tuple[str, str, str]:
        n = self.name
        return (f"{n}.partials_max", f"{n}.partials_sumexp", f"{n}.partials_wsum")

    def reference(self, env: ReferenceEnv) -> None:
        v = env.values[self.of]
        M = v.shape[0]
        logp = torch.log_softmax(v, dim=1)
        p = torch.exp(logp)
        ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(1)
        env.outputs[self.name] = torch.where(v.amax(1) == NEG_INF, torch.zeros_like(ent), ent)
        if self.lse is not None:
            env.outputs[self.lse] = torch.logsumexp(v, dim=1)
        if env.tile is None:
            return
        blocks = _padded_blocks(env, v, self.of)
        nt = blocks.shape[1]
        blocks = blocks.reshape(M * nt, -1)
        pm = blocks.amax(1)
        base = torch.where(pm == NEG_INF, torch.zeros_like(pm), pm)
        ps, pt = _entropy_terms(blocks, base)
        pmax, psum, pwsum = self.partial_names
        env.outputs[pmax] = pm.reshape(M, nt)
        env.outputs[psum] = ps.reshape(M, nt)
        env.outputs[pwsum] = pt.reshape(M, nt)

    def visit(self, sub: Subtile, state: dict[str, torch.Tensor]) -> None:
        v, rows = self._visited(sub)
        m_old, s_old, t_old = state["m"][rows], state["s"][rows], state["t"][rows]
        m_new = torch.maximum(m_old, v.amax(1))
        base = torch.where(m_new == NEG_INF, torch.zeros_like(m_new), m_new)
        finite_old = torch.where(m_old == NEG_INF, base, m_old)
        f = torch.exp(m_old - base)
        s_sub, t_sub = _entropy_terms(v, base)
        # every new value before any store: the olds are views of the state
        s_new = s_old * f + s_sub
        t_new = (t_old + (finite_old - base) * s_old) * f + t_sub
        state["m"][rows], state["s"][rows], state["t"][rows] = m_new, s_new, t_new

    def finalize(
        self,
        partials: Mapping[str, torch.Tensor],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> dict[str, torch.Tensor]:
        pmax, psum, pwsum = self.partial_names
        pm, ps = partials[pmax], partials[psum]
        out = {self.name: _entropy_of(pm, ps, partials[pwsum])}
        if self.lse is not None:
            out[self.lse] = _lse_of(pm, ps)
        return out

    traces_finalize = True

    def trace_finalize(self, fin: Any) -> None:
        from coda.primitives import tracing

        pm, ps, pt = (fin.tensor(n) for n in self.partial_names)
        lse = None if self.lse is None else fin.tensor(self.lse)
        tracing.finalize_entropy(
            pm, ps, pt, fin.tensor(self.name), lse, fin.row, fin.lane, fin.lanes
        )

    def trace(self, ctx: Any, values: dict[str, Any], state: dict) -> None:
        from coda.primitives import math as cm
        from coda.primitives import tracing

        v, x, sub_max = self._masked_row_max(ctx, values)
        for band, r, old, new_m, base in self._rows(ctx, state, sub_max):
            total = weighted = None
            for i in v.frag.row_members(r):
                # exp(x - max) <= 1 by exp_diff, as LogSumExp's terms (0 for x = -inf);
                # both sums start at their first term, as LogSumExp's (no add of 0:
                # ``tracing.sum_terms``, written out here to add the two in one pass)
                e = cm.exp_diff(x[i], base)
                d = cm.maximum(x[i] - base, ENTROPY_FLOOR)
                if total is None:
                    total, weighted = e, e * d
                else:
                    total = total + e
                    weighted = weighted + e * d
            total = tracing.fr.quad_allreduce("sum", total)
            weighted = tracing.fr.quad_allreduce("sum", weighted)
            if old is not None:
                m_old = tracing.finite_or_zero(old[0])  # -inf: s = t = 0, nothing to add
                f = cm.exp_diff(old[0], base)
                total = total + old[1] * f
                weighted = weighted + (old[2] + (m_old - base) * old[1]) * f
            band.put(r, (new_m, total, weighted))


@attrs.frozen
class TargetSelect(StateTransition):
    """Pick ``of[m, target[m]]`` per row -> output ``name`` (M,); ignored rows give 0."""

    target: str = attrs.field(default="target", validator=new_name)
    ignore_index: int = attrs.field(default=-100, validator=integer)
    target_dtype: torch.dtype = attrs.field(default=torch.int64, validator=index_dtype)

    @property
    def partial_names(self) -> tuple[str]:
        return (f"{self.name}.partials",)

    @property
    def label(self) -> str:
        return f"TargetSelect({self.name!r} = {self.of!r}[{self.target}])"

    def tensors(self, values: Mapping[str, ValueSpec]) -> tuple[TensorSpec, ...]:
        return (TensorSpec(self.target, "row", self.target_dtype),) + super().tensors(values)

    def check_tensors(
        self,
        tensors: Mapping[str, Any],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> None:
        t = tensors[self.target]
        C = problem.cols(specs[self.of].width)
        bad = (t != self.ignore_index) & ((t < 0) | (t >= C))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise InputError(
                f"{self.label}: {self.target}[{row}] = {int(t[row])} is not a column index "
                f"of {self.of!r} (0 <= target < {C}) nor ignore_index={self.ignore_index}"
            )

    def reference(self, env: ReferenceEnv) -> None:
        v = env.values[self.of]
        M, C = v.shape
        t = env.tensors[self.target].to(torch.int64)
        keep = t != self.ignore_index
        idx = torch.where(keep, t, torch.zeros_like(t))
        picked = torch.where(keep, v.gather(1, idx[:, None])[:, 0], torch.zeros_like(v[:, 0]))
        env.outputs[self.name] = picked
        if env.tile is None:
            return
        tc = int(env.tile[1] * env.specs[self.of].width)
        nt = ceil_div(env.problem.N, env.tile[1])
        partials = torch.zeros((M, nt), dtype=v.dtype, device=v.device)
        partials.scatter_(1, (idx // tc)[:, None], picked[:, None])
        env.outputs[self.partial_names[0]] = partials

    def begin_tile(self, tile: Tile) -> torch.Tensor:
        return tile.full_rows(0.0)

    def visit(self, sub: Subtile, state: torch.Tensor) -> None:
        w = sub.specs[self.of].width
        v = sub.values[self.of]
        t = sub.load_row(self.target)  # (sm, 1) int64; out-of-bounds rows read -1
        hit = (sub.col_index(w) == t) & (t != self.ignore_index) & sub.mask(w)
        rows = sub.local_rows()
        state[rows] = state[rows] + torch.where(hit, v, torch.zeros_like(v)).sum(1)

    def end_tile(self, tile: Tile, state: torch.Tensor) -> None:
        tile.write_row_partial(self.partial_names[0], state)

    def finalize(
        self,
        partials: Mapping[str, torch.Tensor],
        problem: Problem,
        specs: Mapping[str, ValueSpec],
    ) -> dict[str, torch.Tensor]:
        return {self.name: partials[self.partial_names[0]].sum(1)}

    traces_finalize = True

    def trace_finalize(self, fin: Any) -> None:
        from coda.primitives import tracing

        p = fin.tensor(self.partial_names[0])
        tracing.finalize_row_reduce(
            p, fin.tensor(self.name), fin.row, fin.lane, None, "sum", None, fin.lanes
        )

    def trace_begin_tile(self, tile: Any) -> dict:
        return {}

    def trace(self, ctx: Any, values: dict[str, Any], state: dict) -> None:
        from coda.primitives import tracing

        v = ctx.view_of(self.of)
        # no per-element bounds mask: a target past the columns is -1 here (selects
        # nothing), and rows past M are never written
        x = tracing.to_rmem(values[self.of], v.layout)
        target = ctx.extra(self.target)
        band = state[ctx.subtile[0]]
        for r in v.frag.rows:
            row = tracing.row_of(ctx, r)
            want = tracing.load_index(target, row, ctx.shape_mn[0], self.ignore_index)
            want = tracing.index_below(want, v.shape_mn[1])
            # A row's target is one column, held by at most one element of one lane of the
            # quad: each lane keeps the element it holds there, by selects alone (no FP32
            # add an element), across the band's subtiles; the quad's lanes combine once,
            # at the band's end (``trace_end_band``).
            old = band.old(ctx, r)
            picked = tracing.Float32(0.0) if old is None else old[0]
            for i in v.frag.row_members(r):
                picked = tracing.select_eq_else(v.coords[i][1], want, x[i], picked)
            band.put(r, (picked,))

    rollable = True

    def trace_begin_band(self, ctx: Any, state: dict, rolled: bool) -> None:
        from coda.primitives import tracing

        rows = ctx.view_of(self.of).frag.rows
        state[ctx.subtile[0]] = tracing.BandRows(rows, 1, (0.0,) if rolled else None)

    def trace_end_band(self, ctx: Any, state: dict) -> None:
        from coda.primitives import tracing

        band = state[ctx.subtile[0]]
        tracing.quad_allreduce_band(band, "sum")  # 0 on every lane but (at most) one
        tracing.write_band(ctx, band, self.partial_names)
