"""The fused Llama-block patterns vs eager, torch.compile, Liger-Kernel and the GEMM floor.

    python benchmarks/patterns.py [--out benchmarks/results/patterns_h200.json]
                                  [--H 2048,4096,8192] [--M 16384] [--rounds 5]
                                  [--patterns residual_rmsnorm,swiglu_mlp,qkv_rope]

Patterns (bf16, M tokens, hidden size H, FFN = round_up(8H/3, 256), head_dim 128,
H/128 query heads, 8 KV heads, as in benchmarks/gemm.py):

* ``residual_rmsnorm``: x = a @ w_o.T + residual (H -> H), z = rmsnorm(x) * gamma @ w.T
  (H -> H); coda: ``linear_add_rms_norm`` + ``rms_norm_linear``. Outputs x and z.
* ``swiglu_mlp``: out = x + down(silu(n @ w_g.T) * (n @ w_u.T)), n = rmsnorm(x) * gamma;
  coda: ``swiglu_mlp`` (which also makes the next norm's caches).
* ``qkv_rope``: q, k, v = rope(n @ w_q.T), rope(n @ w_k.T), n @ w_v.T (HF rotate-half,
  per-token positions, rope_theta 500000); coda: ``qkv_rope``.

coda's consumer ops take the stream's norm caches (h, rstd) from the GEMM before them; in
``swiglu_mlp`` and ``qkv_rope`` those caches are made outside the timed region (in a
model the previous GEMM's epilogue makes them), while the others compute the norm inside.
Contenders per pattern and pass (``fwd``: forward under no_grad; ``fwd+bwd``: forward,
then ``torch.autograd.grad`` of every input and weight for fixed random output gradients):
coda, eager PyTorch (textbook ops), torch.compile of the same eager function, Liger-Kernel
(its RMSNorm, SwiGLU and RoPE ops between torch GEMMs; the column is null when
``liger_kernel`` is not installed), and the GEMM floor: the pattern's GEMMs alone, same
shapes and layouts (fwd: X @ W.T; bwd adds dgrad dY @ W and wgrad dY.T @ X per GEMM), on
cuBLAS (torch.mm) and on coda's own mainloop (``coda.gemm``). Timing: interleaved
rounds, the median per contender (benchmarks/common.py). Peak memory: max allocated over
one call of the pass (inputs and weights included), for coda and torch.compile.
Writes JSON (device, versions, command, rows) and a PNG (if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import coda  # noqa: E402
from coda.fusions import (  # noqa: E402
    NormedStream,
    layouts,
    linear_add_rms_norm,
    qkv_rope,
    rms_norm_linear,
    rms_norm_stats,
    swiglu_mlp,
)

BF16 = torch.bfloat16
EPS = 1e-5
HEAD_DIM, KV_HEADS, THETA = 128, 8, 500000.0
PATTERNS = ("residual_rmsnorm", "swiglu_mlp", "qkv_rope")


def ffn_size(h: int) -> int:
    return -(-8 * h // 3 // 256) * 256


def _liger():
    """Liger-Kernel's (rms_norm, swiglu, rope) functions, or None if not installed."""
    try:
        from liger_kernel.transformers.functional import liger_rms_norm, liger_rope, liger_swiglu
    except ImportError:
        return None
    return liger_rms_norm, liger_swiglu, liger_rope


def _param(*shape, scale=1.0, offset=0.0, g=None):
    t = offset + scale * torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32)
    return t.to(BF16).requires_grad_()


def rotate_half(t):
    a, b = t.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Pattern:
    """One pattern's inputs and its contenders, as callables for one pass."""

    def __init__(self, name: str, M: int, H: int) -> None:
        self.name, self.M, self.H = name, M, H
        g = torch.Generator(device="cuda").manual_seed(0)
        Fd = ffn_size(H)
        heads = H // HEAD_DIM
        self.x = _param(M, H, g=g)
        self.gamma = _param(H, scale=0.1, offset=1.0, g=g)
        if name == "residual_rmsnorm":
            self.a = _param(M, H, g=g)
            self.w_o, self.w = _param(H, H, scale=H**-0.5, g=g), _param(H, H, scale=H**-0.5, g=g)
            self.inputs = [self.a, self.w_o, self.x, self.gamma, self.w]
            self.gemms = [(M, H, H), (M, H, H)]  # (M, N, K) of each forward GEMM
            self.out_shapes = [(M, H), (M, H)]
        elif name == "swiglu_mlp":
            self.w_gate_up = _param(2 * Fd, H, scale=H**-0.5, g=g)  # [gate; up]
            self.w_down = _param(H, Fd, scale=Fd**-0.5, g=g)
            self.w_inter = layouts.interleave_gate_up(self.w_gate_up.detach()).requires_grad_()
            self.gamma_next = self.gamma.detach().clone()
            self.inputs = [self.x, self.gamma, self.w_gate_up, self.w_down]
            self.coda_inputs = [self.x, self.gamma, self.w_inter, self.w_down]
            self.gemms = [(M, 2 * Fd, H), (M, H, Fd)]
            self.out_shapes = [(M, H)]
        else:
            self.heads, nkv = heads, KV_HEADS * HEAD_DIM
            self.w_q = _param(H, H, scale=H**-0.5, g=g)
            self.w_k, self.w_v = (_param(nkv, H, scale=H**-0.5, g=g) for _ in range(2))
            w_qkv = layouts.qkv_weight(
                self.w_q.detach(), self.w_k.detach(), self.w_v.detach(), HEAD_DIM
            )
            self.w_qkv = w_qkv.requires_grad_()
            self.positions = torch.randint(0, 8192, (M,), device="cuda", generator=g)
            inv_freq = layouts.rope_inv_freq(HEAD_DIM, THETA).cuda()
            self.freq = layouts.rope_frequencies(inv_freq, heads, KV_HEADS, HEAD_DIM)
            angle = self.positions.float()[:, None] * inv_freq[None, :]
            emb = torch.cat((angle, angle), dim=-1)
            self.cos, self.sin = emb.cos().to(BF16)[:, None], emb.sin().to(BF16)[:, None]
            self.inputs = [self.x, self.gamma, self.w_q, self.w_k, self.w_v]
            self.coda_inputs = [self.x, self.gamma, self.w_qkv]
            self.gemms = [(M, H + 2 * nkv, H)]
            self.out_shapes = [(M, H), (M, nkv), (M, nkv)]
        if name != "residual_rmsnorm":
            with torch.no_grad():
                self.h, self.rstd = rms_norm_stats(self.x, self.gamma, EPS)
        self.grads_out = [
            torch.randn(s, device="cuda", generator=g).to(BF16) for s in self.out_shapes
        ]

    # ---- the contenders' forward functions (return the pattern's outputs) -----------------
    def eager(self, rms_norm=None, swiglu=None, rope=None):
        rms_norm = rms_norm or (lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS))
        swiglu = swiglu or (lambda a, b: F.silu(a) * b)
        if self.name == "residual_rmsnorm":
            x = self.a @ self.w_o.T + self.x
            return [x, rms_norm(x, self.gamma) @ self.w.T]
        n = rms_norm(self.x, self.gamma)
        if self.name == "swiglu_mlp":
            gate, up = (n @ self.w_gate_up.T).chunk(2, dim=-1)
            return [self.x + swiglu(gate, up) @ self.w_down.T]
        M = self.M
        q = (n @ self.w_q.T).view(M, self.heads, HEAD_DIM)
        k = (n @ self.w_k.T).view(M, KV_HEADS, HEAD_DIM)
        v = n @ self.w_v.T
        if rope is None:
            q = q * self.cos + rotate_half(q) * self.sin
            k = k * self.cos + rotate_half(k) * self.sin
        else:  # Liger's layout: (batch, heads, seq, dim), cos/sin (1, seq, dim)
            q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
            q, k = rope(q, k, self.cos[:, 0][None], self.sin[:, 0][None])
            q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
        return [q.reshape(M, -1), k.reshape(M, -1), v]

    def coda(self):
        if self.name == "residual_rmsnorm":
            x, h, rstd = linear_add_rms_norm(self.a, self.w_o, self.x, self.gamma, EPS)
            return [x, rms_norm_linear(x, h, rstd, self.gamma, self.w)]
        stream = NormedStream(self.x, self.h, self.rstd)
        if self.name == "swiglu_mlp":
            s = swiglu_mlp(stream, self.gamma, self.w_inter, self.w_down, self.gamma_next, EPS)
            return [s.x]
        q, k, v = qkv_rope(
            stream,
            self.gamma,
            self.w_qkv,
            self.positions,
            self.freq,
            self.heads,
            KV_HEADS,
            HEAD_DIM,
        )
        return [q.reshape(self.M, -1), k.reshape(self.M, -1), v.reshape(self.M, -1)]

    # ---- passes ----------------------------------------------------------------------------
    def fwd(self, fn: Callable[[], list]) -> Callable[[], object]:
        def run():
            with torch.no_grad():
                return fn()

        return run

    def fwd_bwd(self, fn: Callable[[], list], inputs: list) -> Callable[[], object]:
        def run():
            outs = fn()
            return torch.autograd.grad(outs, inputs, self.grads_out)

        return run

    def floor(self, mm: Callable, backward: bool) -> Callable[[], object]:
        """The pattern's GEMMs alone: fwd X @ W.T; with backward also dY @ W, dY.T @ X."""
        ops = []
        for M, N, K in self.gemms:
            X, W = (
                torch.randn(M, K, device="cuda").to(BF16),
                torch.randn(N, K, device="cuda").to(BF16),
            )
            dY = torch.randn(M, N, device="cuda").to(BF16)
            ops.append((X, W))
            if backward:
                ops += [(dY, W.t()), (dY.t(), X.t())]

        def run():
            for A, B in ops:
                mm(A, B)

        return run


def cublas_mm(A, B):
    return torch.mm(A, B.t())


def coda_mm(A, B):
    return coda.gemm(A, B)


def peak_gib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def contenders(p: Pattern, compiled: Callable, liger, backward: bool) -> dict:
    """name -> callable running one pass of ``p`` (fwd, or fwd+bwd when ``backward``)."""

    def wrap(fn, inputs):
        return p.fwd_bwd(fn, inputs) if backward else p.fwd(fn)

    out = {
        "coda": wrap(p.coda, getattr(p, "coda_inputs", p.inputs)),
        "eager": wrap(p.eager, p.inputs),
        "compile": wrap(compiled, p.inputs),
        "cublas_floor": p.floor(cublas_mm, backward),
        "coda_floor": p.floor(coda_mm, backward),
    }
    if liger is not None:
        rms, swiglu, rope = liger

        def liger_fn():
            return p.eager(
                rms_norm=lambda x, w: rms(x, w, EPS, in_place=False), swiglu=swiglu, rope=rope
            )

        out["liger"] = wrap(liger_fn, p.inputs)
    return out


def bench(name: str, M: int, H: int, rounds: int, liger) -> list[dict]:
    p = Pattern(name, M, H)
    # a fresh dynamo cache per pattern and H: ``Pattern.eager`` is one code object for
    # every pattern, so a shared cache would hit the recompile limit (8) and fall back to
    # eager, or turn dynamic after the first new shape
    torch._dynamo.reset()
    compiled = torch.compile(p.eager)
    rows = []
    for pass_ in ("fwd", "fwd+bwd"):
        fns = contenders(p, compiled, liger, backward=pass_ == "fwd+bwd")
        times = common.interleaved(fns, rounds=rounds, reps=10, warmup=3)
        med = {k: common.median(v) for k, v in times.items()}
        rows.append(
            {
                "pattern": name,
                "H": H,
                "M": M,
                "pass": pass_,
                "coda_ms": med["coda"],
                "eager_ms": med["eager"],
                "compile_ms": med["compile"],
                "liger_ms": med.get("liger"),
                "cublas_floor_ms": med["cublas_floor"],
                "coda_floor_ms": med["coda_floor"],
                "coda_peak_gib": peak_gib(fns["coda"]),
                "compile_peak_gib": peak_gib(fns["compile"]),
            }
        )
    return rows


def chart(rows: list[dict], path: str) -> None:
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no chart")
        return
    cols = ["coda_ms", "compile_ms", "liger_ms", "eager_ms", "coda_floor_ms"]
    labels = [f"{r['pattern']} H={r['H']} {r['pass']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, 0.6 * len(rows)), 4.5))
    width = 0.8 / len(cols)
    for j, col in enumerate(cols):
        ys = [(r[col] / r["cublas_floor_ms"]) if r[col] is not None else 0 for r in rows]
        ax.bar(
            [i + (j - len(cols) / 2) * width for i in range(len(rows))], ys, width, label=col[:-3]
        )
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
    ax.set_ylabel("time / cuBLAS GEMM floor")
    ax.set_title("Llama-block patterns, " + torch.cuda.get_device_name(0))
    ax.legend(fontsize=7)
    common.save_figure(plt, fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/patterns_h200.json")
    p.add_argument("--H", default="2048,4096,8192")
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--patterns", default=",".join(PATTERNS))
    args = p.parse_args(argv)
    liger = _liger()
    rows = []
    for H in (int(h) for h in args.H.split(",")):
        for name in args.patterns.split(","):
            rows += bench(name, args.M, H, args.rounds, liger)
            torch.cuda.empty_cache()
            # written after every pattern: a run cut short keeps what it finished
            common.write_json(
                args.out,
                {
                    **common.environment(),
                    "liger_kernel": None if liger is None else _liger_version(),
                    "rows": rows,
                },
            )
    chart(rows, os.path.splitext(args.out)[0] + ".png")
    common.print_table(
        [{k: ("-" if v is None else v) for k, v in r.items()} for r in rows],
        [
            "pattern",
            "H",
            "pass",
            "coda_ms",
            "coda_floor_ms",
            "cublas_floor_ms",
            "compile_ms",
            "liger_ms",
            "eager_ms",
            "coda_peak_gib",
            "compile_peak_gib",
        ],
    )


def _liger_version() -> str:
    from importlib.metadata import version

    return version("liger-kernel")


if __name__ == "__main__":
    main()
