"""Widening a 16-bit weight gradient to fp32: PyTorch's cast against coda's map pass.

    python benchmarks/cast_widen.py [--out benchmarks/results/cast_widen_h200.json]

Under AMP (fp32 parameters, GEMMs in bf16) every weight gradient arrives in bf16 and is
cast up to its parameter's fp32. PyTorch's copy with a dtype change from bf16 to fp32
runs its unvectorized kernel; ``coda.fusions._dispatch.widen`` (what coda's
``cast`` uses in backward) runs a map pass instead (TileLoad bf16 -> TileStore fp32).
Times both on the weight shapes of a Llama 3.2 1B layer and its tied head / embedding
(``common.interleaved``, rotated: each round times both, medians over rounds), checks they give the
same bits, and writes JSON rows ``{"name", "rows", "cols", "torch_us", "widen_us",
"torch_gbps", "widen_gbps", "speedup", "bitwise_equal"}`` (bytes: 2 read + 4 written per
element), ``gate_up_rows`` for AMP's gate/up weight layout (:func:`gate_up_rows`: PyTorch's
casts and copies against ``coda.fusions.cast_layouts``' map passes) and a PNG beside it
(``--replot FILE`` redraws it from a written JSON).
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.fusions import cast_layouts, layouts  # noqa: E402
from coda.fusions._dispatch import widen  # noqa: E402

#: (name, rows, cols): the 1B model's weight gradients (H = 2048, FFN 8192, 32 / 8 heads
#: of 64), the q|k|v and gate/up ones as coda's fused layouts produce them
SHAPES = (
    ("qkv", 3072, 2048),
    ("o", 2048, 2048),
    ("gate_up", 16384, 2048),
    ("down", 2048, 8192),
    ("head", 128256, 2048),
)


def chart(payload: dict, png: str) -> bool:
    """Bars of GB/s per shape, PyTorch's cast beside the map pass; False without
    matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = payload["rows"]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar([x - 0.2 for x in xs], [r["torch_gbps"] for r in rows], 0.4, label="torch .to(fp32)")
    ax.bar([x + 0.2 for x in xs], [r["widen_gbps"] for r in rows], 0.4, label="coda widen")
    ax.set_xticks(list(xs), [f"{r['name']}\n{r['rows']}x{r['cols']}" for r in rows])
    ax.set_ylabel("GB/s (2 B read + 4 B written)")
    ax.set_title(f"bf16 -> fp32 weight gradients, {payload.get('device', '')}")
    ax.legend()
    common.save_figure(plt, fig, png)
    return True


#: the autograd context of ``layouts._AssembleGateUp.backward`` called directly: both grads
BOTH = types.SimpleNamespace(needs_input_grad=(True, True))

#: (name, F, H): the gate / up weights of Llama 3.2 1B and Llama 3 8B
GATE_UP_SHAPES = (("llama3-1b", 8192, 2048), ("llama3-8b", 14336, 4096))


def median_us(theirs, ours, rounds: int, reps: int) -> tuple[float, float]:
    """Median us per call of PyTorch's way and coda's, interleaved and rotated."""
    times = common.interleaved({"torch": theirs, "coda": ours}, rounds, reps, rotate=True)
    return tuple(1e3 * common.median(times[k]) for k in ("torch", "coda"))


def gate_up_rows(rounds: int, reps: int) -> list[dict]:
    """AMP's gate/up weight made from fp32 gate / up (forward, and the backward's fp32
    gradients from the interleaved 16-bit one): PyTorch's composition (two casts and the
    interleave's row copies; the gradient's row copies out of it and two widenings, as
    ``cast`` widens them) against ``cast_layouts.cast_gate_up``'s one map pass each way.
    Rows ``{"name", "F", "H", "pass", "torch_us", "coda_us", "speedup",
    "bitwise_equal"}``."""
    bf16 = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for name, F, H in GATE_UP_SHAPES:
        gate, up = (torch.randn(F, H, device="cuda", generator=gen) for _ in range(2))
        d = torch.randn(2 * F, H, device="cuda", generator=gen).to(bf16)

        def torch_forward(gate=gate, up=up):
            return layouts.assemble_gate_up(gate.to(bf16), up.to(bf16))

        def torch_backward(d=d):
            g16, u16 = layouts._AssembleGateUp.backward(BOTH, d)
            return widen(g16, torch.float32), widen(u16, torch.float32)

        def coda_forward(gate=gate, up=up):
            return cast_layouts.cast_gate_up(gate, up, bf16)

        def coda_backward(d=d):
            return cast_layouts._CastGateUp.backward(None, d)[:2]

        passes = {
            "forward": (torch_forward, coda_forward),
            "backward": (torch_backward, coda_backward),
        }
        for which, (theirs, ours) in passes.items():
            a, b = theirs(), ours()
            a, b = (a,) if torch.is_tensor(a) else a, (b,) if torch.is_tensor(b) else b
            same = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
            t_us, c_us = median_us(theirs, ours, rounds, reps)
            row = {"name": name, "F": F, "H": H, "pass": which, "torch_us": round(t_us, 2),
                   "coda_us": round(c_us, 2), "speedup": round(t_us / c_us, 3),
                   "bitwise_equal": bool(same)}  # fmt: skip
            print(row)
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/cast_widen_h200.json")
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, m, n in SHAPES:
        g = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
        theirs = lambda g=g: g.to(torch.float32)  # noqa: E731
        ours = lambda g=g: widen(g, torch.float32)  # noqa: E731
        same = torch.equal(theirs().view(torch.int32), ours().view(torch.int32))
        t_us, w_us = median_us(theirs, ours, args.rounds, args.reps)
        nbytes = 6 * m * n
        rows.append(
            {
                "name": name,
                "rows": m,
                "cols": n,
                "torch_us": round(t_us, 2),
                "widen_us": round(w_us, 2),
                "torch_gbps": round(nbytes / t_us / 1e3, 1),
                "widen_gbps": round(nbytes / w_us / 1e3, 1),
                "speedup": round(t_us / w_us, 3),
                "bitwise_equal": bool(same),
            }
        )
        print(rows[-1])
    payload = {
        **common.environment(),
        "command": " ".join(sys.argv),
        "rows": rows,
        "gate_up_rows": gate_up_rows(args.rounds, args.reps),
    }
    common.write_json(args.out, payload)
    chart(payload, common.png_beside(args.out))


if __name__ == "__main__":
    main()
