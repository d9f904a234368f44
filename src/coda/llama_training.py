"""coda.llama_training: a Hugging Face Llama trained with coda and with eager PyTorch, side by side.

A tool over the whole library, beside ``coda.demo_llama`` (it imports
``coda.integrations.transformers``; nothing below it imports this module). Shared by the
GPU path of ``python -m coda demo`` and by ``benchmarks/train_loss.py`` (which is not part
of the installed package, so the logic lives here).

* ``markov_tokens``: a locally generated corpus with learnable structure (a noisy
  first-order Markov chain: the next token is ``perm[token]`` with probability
  ``1 - noise``, else uniform), from a fixed seed; no downloads.
* ``LlamaSize`` / ``PRESETS``: small random ``LlamaConfig`` sizes ("small": H=512, 4
  layers, 8 query / 4 KV heads, FFN 1536, vocab 32000; "tiny" for CPU smoke runs).
* ``train_side_by_side``: one model initialized once, deep-copied before patching, then
  trained for ``steps`` AdamW steps as ``coda`` (patched with ``apply_coda``, strict: every
  step must run the fused stack and loss) and ``eager`` (the unpatched copy), in the same
  dtype, on the same batches, alternating step by step; optionally a third copy,
  ``reference``, in a higher precision (fp32 when the others are bf16, float64 when they
  are fp32). Returns a ``SideBySide``: both loss curves, their agreement (raw and as
  trailing moving averages), time per step and tokens/s, and peak memory per method.

Agreement rule (``AGREEMENT_BOUND``, stated here and recorded in every result): the
largest |difference| of the two loss curves' trailing 20-step moving averages (the window
shrinks to the steps run when fewer) is at most 0.05 nats. With a reference run the
results also hold DESIGN.md 6.3's rule for the curves: max |MA(coda) - MA(reference)| <= 2
x max |MA(eager) - MA(reference)| + ``REFERENCE_ATOL`` (recorded, informational: two
low-precision runs of a chaotic optimization drift apart by chance).

Peak memory per method, when several models share one GPU: the method's own resident
bytes (parameters and optimizer state, counted from its tensors) plus the most that
``torch.cuda.max_memory_allocated`` rose above ``memory_allocated`` during any of its
steps after the first (activations, gradients, temporaries; the first step also creates
the optimizer state). The other models' resident memory is constant during the step, so
it cancels.
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

__all__ = [
    "AGREEMENT_BOUND",
    "MA_WINDOW",
    "PRESETS",
    "REFERENCE_ATOL",
    "LlamaSize",
    "SideBySide",
    "TrainSetup",
    "build_model",
    "markov_tokens",
    "moving_average",
    "plot_losses",
    "progress",
    "resident_bytes",
    "train_side_by_side",
]

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
GiB = 2**30

#: max |MA(coda) - MA(eager)| (nats) over the run, MA = trailing ``MA_WINDOW``-step mean
AGREEMENT_BOUND = 0.05
MA_WINDOW = 20
#: absolute slack of the (informational) rule against the higher-precision reference run
REFERENCE_ATOL = 0.01

T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """``items`` with a progress bar on stderr: tqdm's when installed, else a text bar
    (one line per 5%). ``enabled=False`` yields the items silently."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc=desc, dynamic_ncols=True)
        return
    shown = -1
    for i, item in enumerate(items, 1):
        yield item
        pct = 100 * i // max(total, 1)
        if pct // 5 != shown // 5 or i == total:
            shown = pct
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            print(f"{desc} [{bar}] {i}/{total}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LlamaSize:
    """The sizes of a random ``LlamaConfig`` (Llama: RMSNorm, SwiGLU, RoPE, GQA)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def config(self, attn_implementation: str = "sdpa", **extra: Any) -> Any:
        """The ``transformers.LlamaConfig`` (RoPE spelled for the installed version)."""
        from transformers import LlamaConfig

        from coda.integrations.transformers import rope_config

        rope = rope_config("default", self.rope_theta)
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=extra.pop("max_position_embeddings", 131072),
            rms_norm_eps=1e-5,
            tie_word_embeddings=self.tie_embeddings,
            attn_implementation=attn_implementation,
            use_cache=False,
            **rope,
            **extra,
        )


PRESETS: dict[str, LlamaSize] = {
    # benchmarks/train_loss.py and the GPU demo: head_dim 64, GQA 2:1
    "small": LlamaSize(vocab=32000, hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=4),
    # CPU smoke runs (coda's reference path in fp32)
    "tiny": LlamaSize(vocab=256, hidden=64, intermediate=160, layers=2, heads=4, kv_heads=2),
}


def markov_tokens(vocab: int, rows: int, seq: int, seed: int, noise: float = 0.1) -> torch.Tensor:
    """(rows, seq) int64 tokens of a noisy Markov chain, generated on the CPU from
    ``seed``: token 0 of a row is uniform, then each next token is ``perm[previous]`` with
    probability ``1 - noise``, else uniform (``perm`` a random permutation). The best
    achievable loss is about ``H(1 - noise) + noise * ln(vocab)`` nats per token."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab, generator=g)
    ids = torch.empty(rows, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(vocab, (rows,), generator=g)
    flip = torch.rand(rows, seq, generator=g) < noise
    rand = torch.randint(vocab, (rows, seq), generator=g)
    for t in range(1, seq):
        ids[:, t] = torch.where(flip[:, t], rand[:, t], perm[ids[:, t - 1]])
    return ids


def moving_average(xs: Sequence[float], window: int = MA_WINDOW) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of ``model``'s parameters and buffers and ``optimizer``'s state tensors
    (each storage counted once)."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()

    for t in (*model.parameters(), *model.buffers()):
        add(t)
    if optimizer is not None:
        for state in optimizer.state.values():
            for t in state.values():
                add(t)
    return total


def build_model(size: LlamaSize, dtype: torch.dtype, device: str | torch.device, seed: int) -> Any:
    """A ``LlamaForCausalLM`` with Hugging Face's own random init (from ``seed``), in
    ``dtype`` on ``device``, SDPA attention, no KV cache."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(size.config())
    return model.to(dtype)


@dataclass
class TrainSetup:
    """One side-by-side run. ``reference_dtype`` None: no reference run."""

    size: LlamaSize = PRESETS["small"]
    seq: int = 1024
    batch: int = 4
    steps: int = 200
    lr: float = 1e-3
    #: linear learning-rate warm-up steps; None: steps // 10
    warmup: int | None = None
    weight_decay: float = 0.01
    dtype: torch.dtype = BF16
    reference_dtype: torch.dtype | None = F32
    device: str = "cuda"
    seed: int = 0
    #: steps at the start left out of the timing (compilation, allocator warm-up)
    timing_skip: int = 10


@dataclass
class SideBySide:
    """The result of ``train_side_by_side`` (``to_json()`` for a JSON file)."""

    setup: dict[str, Any]
    losses: dict[str, list[float]]
    step_ms: dict[str, list[float]]
    median_step_ms: dict[str, float]
    tokens_per_s: dict[str, float]
    peak_gib: dict[str, float | None]
    agreement: dict[str, Any]
    coda_calls: dict[str, int]
    coda_fallbacks: dict[str, int]
    learned: bool
    passed: bool
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _agreement(losses: dict[str, list[float]], steps: int) -> dict[str, Any]:
    window = min(MA_WINDOW, steps)
    coda, eager = losses["coda"], losses["eager"]
    ma = {k: moving_average(v, window) for k, v in losses.items()}
    diff = [c - e for c, e in zip(coda, eager, strict=True)]
    ma_diff = [c - e for c, e in zip(ma["coda"], ma["eager"], strict=True)]
    out: dict[str, Any] = {
        "rule": (
            f"max |MA{window}(coda) - MA{window}(eager)| <= {AGREEMENT_BOUND} nats "
            f"(MA{window}: trailing {window}-step mean of the per-step losses)"
        ),
        "bound_nats": AGREEMENT_BOUND,
        "window": window,
        "max_abs_diff": max(abs(d) for d in diff),
        "mean_abs_diff": sum(abs(d) for d in diff) / len(diff),
        "max_abs_ma_diff": max(abs(d) for d in ma_diff),
        "final_loss": {k: v[-1] for k, v in losses.items()},
        "final_ma_loss": {k: v[-1] for k, v in ma.items()},
        "moving_average": ma,
    }
    out["ok"] = out["max_abs_ma_diff"] <= AGREEMENT_BOUND
    if "reference" in losses:
        err = {
            k: max(abs(a - b) for a, b in zip(ma[k], ma["reference"], strict=True))
            for k in ("coda", "eager")
        }
        out["vs_reference"] = {
            "rule": (
                f"max |MA(coda) - MA(reference)| <= 2 x max |MA(eager) - MA(reference)| + "
                f"{REFERENCE_ATOL} (informational)"
            ),
            "coda_err": err["coda"],
            "eager_err": err["eager"],
            "ok": err["coda"] <= 2 * err["eager"] + REFERENCE_ATOL,
        }
    return out


def train_side_by_side(
    setup: TrainSetup,
    *,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    show_progress: bool = True,
) -> SideBySide:
    """Train coda and eager (and the reference) side by side; see the module doc.
    ``on_step(step, {method: loss})`` is called after every step."""
    from coda.integrations.transformers import apply_coda

    device = torch.device(setup.device)
    cuda = device.type == "cuda"
    tokens = markov_tokens(
        setup.size.vocab, setup.steps * setup.batch, setup.seq, seed=setup.seed + 1
    ).view(setup.steps, setup.batch, setup.seq)
    base = build_model(setup.size, setup.dtype, device, setup.seed)
    models: dict[str, torch.nn.Module] = {"eager": base, "coda": copy.deepcopy(base)}
    if setup.reference_dtype is not None:
        models["reference"] = copy.deepcopy(base).to(setup.reference_dtype)
    patch = apply_coda(models["coda"], strict=True)
    optimizers, schedules = {}, {}
    for name, model in models.items():
        model.train()
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=setup.lr,
            weight_decay=setup.weight_decay,
            fused=cuda or None,
        )
        optimizers[name] = opt
        warm = max(setup.steps // 10 if setup.warmup is None else setup.warmup, 1)
        schedules[name] = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step, warm=warm: min(1.0, (step + 1) / warm)
        )
    order = ["coda", "eager", *(["reference"] if "reference" in models else [])]
    losses: dict[str, list[float]] = {k: [] for k in order}
    step_ms: dict[str, list[float]] = {k: [] for k in order}
    workspace: dict[str, int] = dict.fromkeys(order, 0)
    resident: dict[str, int] = dict.fromkeys(order, 0)
    logits_none = True

    for step in progress(range(setup.steps), setup.steps, "training", show_progress):
        ids = tokens[step].to(device, non_blocking=True)
        for name in order:
            model, opt = models[name], optimizers[name]
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
            else:
                t0 = time.perf_counter()
            out = model(ids, labels=ids)
            out.loss.backward()
            opt.step()
            schedules[name].step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
                if step:  # step 0 also allocates the optimizer state (counted as resident)
                    rise = torch.cuda.max_memory_allocated() - before
                    workspace[name] = max(workspace[name], rise)
            else:
                ms = 1e3 * (time.perf_counter() - t0)
            step_ms[name].append(ms)
            losses[name].append(float(out.loss.detach().double()))
            if name == "coda":
                logits_none &= out.logits is None
            del out
        if step == 0:
            for name in order:
                resident[name] = resident_bytes(models[name], optimizers[name])
        if on_step is not None:
            on_step(step + 1, {k: v[-1] for k, v in losses.items()})

    timed = slice(min(setup.timing_skip, setup.steps - 1), None)
    median_ms = {k: float(statistics.median(v[timed])) for k, v in step_ms.items()}
    tokens_per_step = setup.batch * setup.seq
    tps = {k: tokens_per_step / (ms / 1e3) for k, ms in median_ms.items()}
    peak = {k: ((resident[k] + workspace[k]) / GiB if cuda else None) for k in order}
    agreement = _agreement(losses, setup.steps)
    fused = patch.calls["fused_stack"] == setup.steps and patch.calls["fused_loss"] == setup.steps
    fused &= not patch.fallbacks and logits_none
    first = losses["coda"][0]
    learned = agreement["final_ma_loss"]["coda"] < first  # the moving average fell
    finite = all(math.isfinite(x) for v in losses.values() for x in v)
    notes = []
    if not fused:
        notes.append(f"not every coda step was fused: calls {dict(patch.calls)}")
    if not finite:
        notes.append("a loss is not finite")
    setup_json = {
        **{k: v for k, v in asdict(setup).items() if k not in ("size", "dtype", "reference_dtype")},
        "size": asdict(setup.size),
        "dtype": _dtype_name(setup.dtype),
        "reference_dtype": (
            None if setup.reference_dtype is None else _dtype_name(setup.reference_dtype)
        ),
        "tokens_per_step": tokens_per_step,
        "parameters": sum(p.numel() for p in base.parameters()),
        "data": "noisy Markov chain (coda.llama_training.markov_tokens), noise 0.1, "
        f"seed {setup.seed + 1}; labels = input_ids",
        "optimizer": f"AdamW(lr={setup.lr:g}, weight_decay={setup.weight_decay:g}, "
        f"fused={cuda}), linear warm-up over "
        f"{max(setup.steps // 10 if setup.warmup is None else setup.warmup, 1)} steps",
    }
    return SideBySide(
        setup=setup_json,
        losses=losses,
        step_ms=step_ms,
        median_step_ms=median_ms,
        tokens_per_s=tps,
        peak_gib=peak,
        agreement=agreement,
        coda_calls=dict(patch.calls),
        coda_fallbacks=dict(patch.fallbacks),
        learned=learned,
        passed=bool(agreement["ok"] and fused and learned and finite),
        notes=notes,
    )


def plot_losses(result: SideBySide, path: str, title: str) -> bool:
    """The loss curves (raw, faint; moving averages, solid) and coda - eager below;
    False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]}
    )
    colors = {"coda": "tab:blue", "eager": "tab:orange", "reference": "tab:gray"}
    ma = result.agreement["moving_average"]
    window = result.agreement["window"]
    styles = {"coda": "--", "eager": "-", "reference": "-"}
    for name in sorted(result.losses, key=("reference", "eager", "coda").index):
        ys = result.losses[name]
        xs = range(1, len(ys) + 1)
        label = f"{name} ({result.setup['reference_dtype']})" if name == "reference" else name
        top.plot(xs, ys, color=colors[name], alpha=0.25, lw=0.8)
        top.plot(
            xs, ma[name], styles[name], color=colors[name], lw=1.6, label=f"{label}, MA{window}"
        )
    top.set_ylabel("training loss (nats)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    diff = [c - e for c, e in zip(result.losses["coda"], result.losses["eager"], strict=True)]
    ma_diff = [c - e for c, e in zip(ma["coda"], ma["eager"], strict=True)]
    xs = range(1, len(diff) + 1)
    bottom.plot(xs, diff, color="tab:purple", alpha=0.35, lw=0.8, label="coda - eager")
    bottom.plot(xs, ma_diff, color="tab:purple", lw=1.6, label=f"MA{window}(coda - eager)")
    bound = result.agreement["bound_nats"]
    for b in (bound, -bound):
        bottom.axhline(b, color="red", ls="--", lw=0.8)
    bottom.axhline(0, color="black", lw=0.5)
    bottom.set_xlabel("step")
    bottom.set_ylabel("difference (nats)")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
