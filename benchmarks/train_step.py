"""A full training step of a Hugging Face Llama: coda vs eager, torch.compile and Liger-Kernel.

    python benchmarks/train_step.py [--configs llama3-1b,h4096-trunc] [--seq 8192]
        [--layers4096 2] [--rounds 5] [--quick] [--mode auto|interleaved|isolated]
        [--no-block | --block-only] [--amp] [--out benchmarks/results/train_step_h200.json]
        [--merge]
    python benchmarks/train_step.py --combine a.json b.json ... --out train_step_h200.json

Sits in benchmarks/ (run from the repository root); needs a CUDA GPU (Hopper for coda).

Training step (rows): ``transformers`` LlamaForCausalLM from a random config, parameters
in bf16 (``model.to(torch.bfloat16)``, as HF trainers with bf16 do), SDPA attention,
AdamW (fused), random ``input_ids`` (batch ``--batch`` x ``--seq``) and
``labels = input_ids``; one step = forward with labels, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``, timed with CUDA events (details: ``median_step_ms``).
With ``--amp``: parameters in fp32 (AMP's master weights) and every forward under
``torch.autocast`` to bf16, the backward outside it; coda's patch gets
``fuse_autocast=True`` (its stack in bf16, weights cast per forward).
Next to it, ``host_ms_per_step``: the host's time to issue one step while a sleep kernel keeps
the GPU busy (median of 3): when it is below the step's GPU time the GPU never waits for
the host (a step that synchronizes shows the sleep's length instead, and so does one that
issues more kernel launches than the GPU's launch queue holds while the sleep runs: the
host then blocks in ``cudaLaunchKernel``, "Command Buffer Full" in a torch.profiler trace,
as coda's 16-layer AMP step does; such a host is ahead of the GPU, not behind). To tell
the two apart, ``syncs_per_step`` (the sites of the synchronizing CUDA calls that
``torch.cuda.set_sync_debug_mode("warn")`` reports in one step) and ``gpu_ops_per_step``
(the kernels, copies and memsets of one step in a torch.profiler trace: launches the
queue must hold). Configs:

* ``llama3-1b``: Llama 3.2 1B's shape: H=2048, 16 layers, FFN 8192, 32 query / 8 KV heads
  (head_dim 64), vocab 128256, tied embeddings, rope_theta 500000 (default RoPE; the
  1B checkpoint's llama3 RoPE scaling changes only the frequencies).
* ``h4096-trunc``: Llama 3 8B's layer shape truncated to ``--layers4096`` layers (default
  2): H=4096, FFN 14336, 32/8 heads (head_dim 128), vocab 128256, untied.

Methods, all built from ONE random init (deep copies made before any patching):
``coda`` (``apply_coda(model, strict=True)``: every step must run the fused stack and
loss), ``eager`` (the unpatched model), ``compile`` (``torch.compile(model)``, default
mode, with Hugging Face's causal mask skipped as eager mode skips it:
``causal_mask_as_eager``; ``--compile-hf-mask`` keeps transformers' own, which under
dynamo before torch 2.14 is an explicit mask that slows attention about 3x), ``liger``
(Liger-Kernel's ``apply_liger_kernel_to_llama(model=...)``: RoPE, RMSNorm, SwiGLU,
fused linear cross-entropy; null when ``liger_kernel`` is not installed). Liger's
instance patch also replaces module-level names of
``transformers.models.llama.modeling_llama`` (``apply_rotary_pos_emb``, ``LlamaRMSNorm``,
``LlamaMLP``); they are restored right after patching and swapped in only around the
Liger model's own steps, so the eager and compiled models keep Hugging Face's functions
(the compiled model's mask function is swapped in the same way, around its own steps).

Timing (DESIGN.md 7): ``--warmup`` steps per method (torch.compile and coda's kernel
compilation happen there), then ``--rounds`` rounds; in a round each method runs
``--reps`` steps back to back, timed by CUDA events; methods alternate within a round
(``interleaved``; ``--rotate``: each round, of the steps and of the block section,
starts at the next one, as ``common.interleaved(rotate=True)``) and the median over
rounds is reported. ``--mode isolated`` builds
one method's model at a time and runs its rounds alone (for GPUs too small for four
models and their optimizers); ``auto`` (default) picks interleaved when an estimate of
four resident models plus one step's workspace fits in the GPU's memory (an H200 fits
both configs; an 80 GB H100 does not fit llama3-1b at seq 8192).

Peak memory (GiB) of a method: its own resident bytes (parameters + AdamW state) plus
the rise of ``max_memory_allocated`` above ``memory_allocated`` over one step after
``reset_peak_memory_stats`` (activations, gradients, workspaces): in interleaved mode the
other models' memory is constant during that step and cancels; in isolated mode the raw
``max_memory_allocated`` of that step is recorded as well (``details``).

Block (``block`` rows): one Llama decoder layer alone at the hidden sizes of ``--configs``
(H=2048 and H=4096 by default, with those configs' layer shapes), M = batch x seq tokens,
``fwd`` (no_grad) and ``fwd+bwd`` (``torch.autograd.grad`` of the input and every weight
for a fixed random output gradient): coda's fused layer
(``coda.nn.FusedLlamaDecoderLayer.from_hf``; its input stream's norm caches are made
outside the timed region, as the previous layer's GEMM makes them in a stack, and it makes
the next layer's), ``torch.compile`` of the HF ``LlamaDecoderLayer`` (cos/sin made
outside), and the floor: the layer's four GEMMs (QKV, O, gate+up, down; fwd+bwd adds dgrad
dY @ W and wgrad dY.T @ X each) plus SDPA (causal, k/v repeated to the query heads outside
the timed region; fwd+bwd: its forward and backward) alone, with the GEMMs on cuBLAS
(``torch.mm``) and on coda's mainloop (``coda.gemm``).

Every method (and block contender) runs inside a guard: a failure records its error
string (``details`` / ``errors``) and a null number, and the run goes on. Writes JSON
(device, versions, command, ``rows``, ``details``, ``block``, ``errors``) and a PNG
(tokens/s and peak memory per config, block times over the cuBLAS floor), then prints
tables.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.llama_training import LlamaSize, progress, resident_bytes  # noqa: E402

BF16 = torch.bfloat16
GiB = 2**30
#: set by main(): "cuda" (the benchmark) or "cpu" (a smoke run of the harness, --device cpu)
DEVICE = "cuda"
DTYPE = BF16
#: ``--amp``: fp32 parameters, each forward under ``torch.autocast`` to bf16
AMP = False
#: ``--compile-hf-mask``: the compiled model keeps transformers' own causal-mask function
COMPILE_HF_MASK = False
METHODS = ("coda", "eager", "compile", "liger")
ROW_FIELDS = (
    "config",
    "H",
    "layers",
    "seq",
    *(f"{m}_tokens_per_s" for m in METHODS),
    *(f"{m}_peak_gib" for m in METHODS),
)


def configs(layers4096: int, tiny: bool = False) -> dict[str, LlamaSize]:
    """The two configs; ``tiny``: the same structure at toy sizes (CPU smoke runs)."""
    if tiny:
        return {
            "llama3-1b": LlamaSize(512, 64, 160, 2, 4, 2, 500000.0, True),
            "h4096-trunc": LlamaSize(512, 128, 352, layers4096, 4, 2, 500000.0, False),
        }
    return {
        "llama3-1b": LlamaSize(
            vocab=128256,
            hidden=2048,
            intermediate=8192,
            layers=16,
            heads=32,
            kv_heads=8,
            rope_theta=500000.0,
            tie_embeddings=True,
        ),
        "h4096-trunc": LlamaSize(
            vocab=128256,
            hidden=4096,
            intermediate=14336,
            layers=layers4096,
            heads=32,
            kv_heads=8,
            rope_theta=500000.0,
            tie_embeddings=False,
        ),
    }


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 600 else text[:600] + "..."


def _free() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Mean milliseconds of ``reps`` back-to-back calls: CUDA events on the GPU
    (benchmarks/common.py), wall time on the CPU."""
    if DEVICE == "cuda":
        return common.time_once(fn, reps)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


# ---- Liger-Kernel ----------------------------------------------------------------------
LIGER_GLOBALS = ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")


def liger_version() -> str | None:
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        return version("liger-kernel")
    except Exception:
        return None


def apply_liger(model: torch.nn.Module) -> dict[str, Any]:
    """Patch ``model`` with Liger-Kernel; returns the module-level names Liger set (to
    swap in around the model's steps), after restoring Hugging Face's."""
    from transformers.models.llama import modeling_llama

    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError:
        from liger_kernel.transformers.monkey_patch import apply_liger_kernel_to_llama
    saved = {n: getattr(modeling_llama, n) for n in LIGER_GLOBALS}
    try:
        apply_liger_kernel_to_llama(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=True,
            model=model,
        )
        return {n: getattr(modeling_llama, n) for n in LIGER_GLOBALS}
    finally:
        for n, v in saved.items():
            setattr(modeling_llama, n, v)


def causal_mask_as_eager(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """Hugging Face's ``create_causal_mask`` for the compiled model, returning what it
    returns in eager mode for these unpadded, unpacked sequences: no mask, so SDPA runs
    ``is_causal=True`` (the flash kernels skip the masked half). transformers skips the
    mask that way in eager mode but never while dynamo traces before torch 2.14
    (``masking_utils._ignore_causal_mask_sdpa``): out of the box the compiled model's
    attention takes an explicit M x M mask and runs its kernels about 3x as long
    (``results/kernel_profile_train_compile_hf_mask_h200.json``)."""
    if attention_mask is not None:
        raise ValueError("causal_mask_as_eager: the benchmark's batches carry no padding mask")
    return None


@contextlib.contextmanager
def swapped(values: dict[str, Any]) -> Iterator[None]:
    """``transformers.models.llama.modeling_llama``'s names set to ``values`` inside."""
    if not values:
        yield
        return
    from transformers.models.llama import modeling_llama

    saved = {n: getattr(modeling_llama, n) for n in values}
    for n, v in values.items():
        setattr(modeling_llama, n, v)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(modeling_llama, n, v)


# ---- the training step -----------------------------------------------------------------
#: how many Python frames ``Method.issue_profile`` records of each synchronizing call
SYNC_FRAMES = 8


class Method:
    """One contender: its model (and the callable that runs it), optimizer and step."""

    def __init__(self, name: str, model: torch.nn.Module, ids: torch.Tensor) -> None:
        self.name, self.model, self.ids = name, model, ids
        self.run: Callable[..., Any] = model
        self.globals: dict[str, Any] = {}
        self.patch: Any = None
        if name == "coda":
            from coda.integrations.transformers import apply_coda

            self.patch = apply_coda(model, strict=True, fuse_autocast=AMP)
        elif name == "compile":
            self.run = torch.compile(model)
            if not COMPILE_HF_MASK:
                self.globals = {"create_causal_mask": causal_mask_as_eager}
        elif name == "liger":
            self.globals = apply_liger(model)
        model.train()
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=1e-5, weight_decay=0.01, fused=DEVICE == "cuda" or None
        )
        self.first_loss: float | None = None
        self.calls: dict[str, int] | None = None
        self.fallbacks: dict[str, int] | None = None

    def step(self) -> None:
        with swapped(self.globals):
            # AMP: the forward under autocast, the backward outside it (PyTorch's advice)
            with torch.autocast(DEVICE, dtype=BF16, enabled=AMP):
                out = self.run(input_ids=self.ids, labels=self.ids)
            out.loss.backward()
        if self.first_loss is None:
            self.first_loss = float(out.loss.detach().float())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def host_ms(self, reps: int = 3) -> float | None:
        """Median over ``reps`` of the milliseconds the host takes to issue one step while
        the GPU is kept busy (a sleep kernel queued first, so the host never waits for the
        GPU unless the step synchronizes): the step's CPU cost. Below the step's GPU time,
        the GPU never waits for the host. None on the CPU."""
        if DEVICE != "cuda":
            return None
        issued = []
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(HOST_SLEEP_CYCLES)
            t0 = time.perf_counter()
            self.step()
            issued.append(1e3 * (time.perf_counter() - t0))
            torch.cuda.synchronize()
        return common.median(issued)

    def issue_profile(self) -> tuple[list[str] | None, int | None]:
        """(synchronizing CUDA calls, GPU operations) in one step: the Python sites
        (``file:line <- caller <- ...``, ``SYNC_FRAMES`` frames, in call order) of the calls
        ``torch.cuda.set_sync_debug_mode("warn")`` reports (an ``.item()``, a copy from
        pageable host memory, ``nonzero``...; not every one makes the host wait for the GPU),
        and the count of kernels, copies and memsets a torch.profiler trace of the step
        records (each takes a slot of the GPU's launch queue). (None, None) on the CPU."""
        if DEVICE != "cuda":
            return None, None
        torch.cuda.synchronize()
        syncs: list[str] = []

        stepping = []  # non-empty while the step runs (not the debug mode's own switches)

        def record(message: Any, *args: Any, **kwargs: Any) -> None:
            if stepping and "synchronizing" in str(message):  # the site, then its callers
                frames = traceback.extract_stack()[:-1][-SYNC_FRAMES:]
                where = (f"{os.path.relpath(f.filename)}:{f.lineno}" for f in reversed(frames))
                syncs.append(" <- ".join(where))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stepping.append(True)
                self.step()
            finally:
                stepping.clear()
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        kinds = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=kinds) as prof:
            self.step()
            torch.cuda.synchronize()
        gpu_ops = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
        return syncs, gpu_ops

    def peak(self) -> tuple[float | None, float | None]:
        """(resident + step workspace, raw max_memory_allocated) in GiB over one step;
        (None, None) on the CPU."""
        if DEVICE != "cuda":
            self.step()
            return None, None
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.step()
        torch.cuda.synchronize()
        raw = torch.cuda.max_memory_allocated()
        own = resident_bytes(self.model, self.opt)
        return (own + raw - before) / GiB, raw / GiB

    def close(self) -> None:
        """Drop the model, optimizer and patch (keeping coda's call counters), so their
        memory can be freed."""
        if self.patch is not None:
            self.calls = dict(self.patch.calls)
            self.fallbacks = dict(self.patch.fallbacks)
        self.model = self.run = self.opt = self.patch = None  # type: ignore[assignment]


#: GPU cycles of the sleep queued before a host-time measurement (~2.5 s at H200 clocks:
#: longer than any step takes to issue)
HOST_SLEEP_CYCLES = 5_000_000_000


def estimate_gib(size: LlamaSize, tokens: int, n_models: int) -> float:
    """Rough memory need: ``n_models`` resident (bf16 params, grads, two AdamW states)
    plus one step's workspace (eager's: ~0.75 GiB per layer per 8k tokens at H=2048,
    scaled by H x F, plus fp32 and bf16 logits and their gradients)."""
    emb = size.vocab * size.hidden * (1 if size.tie_embeddings else 2)
    H, Fd, D = size.hidden, size.intermediate, size.hidden // size.heads
    layer = H * (size.heads + 2 * size.kv_heads) * D + H * H + 3 * H * Fd
    params = emb + size.layers * layer
    resident = 8 * params * n_models
    per_layer = tokens * (10 * H + 8 * Fd) * 2
    logits = tokens * size.vocab * (2 + 4 + 4 + 2)
    return (resident + size.layers * per_layer + logits) / GiB


def bench_config(
    name: str,
    size: LlamaSize,
    args: argparse.Namespace,
    methods: list[str],
) -> tuple[dict, dict]:
    """(the row, its details) of one config."""
    from coda.llama_training import build_model

    tokens = args.batch * args.seq
    need = estimate_gib(size, tokens, len(methods))
    mode = args.mode
    if mode == "auto" and DEVICE == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory / GiB
        mode = "interleaved" if need <= 0.75 * total else "isolated"
    elif mode == "auto":
        mode = "interleaved"
    details: dict[str, Any] = {
        "config": name,
        "size": asdict(size),
        "batch": args.batch,
        "tokens_per_step": tokens,
        "mode": mode,
        "estimated_gib_all_resident": need,
        "errors": {},
        "median_step_ms": {},
        "host_ms_per_step": {},
        "syncs_per_step": {},
        "gpu_ops_per_step": {},
        "step_ms_rounds": {},
        "raw_max_allocated_gib": {},
        "first_loss": {},
    }
    shape = (args.batch, args.seq)
    ids = torch.randint(0, size.vocab, shape, device=DEVICE, generator=generator(0))
    base = build_model(size, DTYPE, DEVICE, seed=0)
    details["parameters"] = sum(p.numel() for p in base.parameters())

    def make(m: str, model: torch.nn.Module) -> Method | None:
        try:
            if m == "liger" and liger_version() is None:
                details["errors"][m] = "liger_kernel is not installed"
                return None
            return Method(m, model, ids)
        except Exception as exc:
            details["errors"][m] = _short(exc)
            traceback.print_exc()
            return None

    def warm(meth: Method) -> bool:
        try:
            for _ in range(args.warmup):
                meth.step()
            sync()
            return True
        except Exception as exc:
            details["errors"][meth.name] = _short(exc)
            traceback.print_exc()
            return False

    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, float] = {}
    hosts: dict[str, float | None] = {}
    issue: dict[str, tuple[list[str] | None, int | None]] = {}
    live: dict[str, Method] = {}
    if mode == "interleaved":
        copies = {m: (base if m == "eager" else copy.deepcopy(base)) for m in methods}
        del base
        for m in methods:
            meth = make(m, copies.pop(m))
            if meth is not None and warm(meth):
                live[m] = meth
            elif meth is not None:
                meth.close()
        meth = None
        _free()
        for r in progress(range(args.rounds), args.rounds, f"{name} rounds"):
            for m in common.round_order(list(live), r, args.rotate):
                try:
                    times[m].append(timed(live[m].step, args.reps))
                except Exception as exc:
                    details["errors"][m] = _short(exc)
                    live.pop(m).close()
                    _free()
        for m in list(live):
            try:
                peaks[m], details["raw_max_allocated_gib"][m] = live[m].peak()
                hosts[m] = live[m].host_ms()
                issue[m] = live[m].issue_profile()
            except Exception as exc:
                details["errors"][m] = _short(exc)
    else:
        state = {k: v.detach().to("cpu", copy=True) for k, v in base.state_dict().items()}
        del base
        _free()
        for m in progress(methods, len(methods), f"{name} methods"):
            try:
                model = build_model(size, DTYPE, DEVICE, seed=0)
                model.load_state_dict(state)
            except Exception as exc:
                details["errors"][m] = _short(exc)
                continue
            meth = make(m, model)
            del model
            if meth is None or not warm(meth):
                if meth is not None:
                    meth.close()
                meth = None
                torch._dynamo.reset()
                _free()
                continue
            try:
                for _ in range(args.rounds):
                    times[m].append(timed(meth.step, args.reps))
                peaks[m], details["raw_max_allocated_gib"][m] = meth.peak()
                hosts[m] = meth.host_ms()
                issue[m] = meth.issue_profile()
            except Exception as exc:
                details["errors"][m] = _short(exc)
            live[m] = meth
            meth.close()
            meth = None
            torch._dynamo.reset()  # the compiled graphs hold the model's tensors
            _free()
    for m, done in live.items():
        done.close()
        if done.first_loss is not None:
            details["first_loss"][m] = done.first_loss
        if done.calls is not None:
            details["coda_calls"] = done.calls
            details["coda_fallbacks"] = done.fallbacks
    row: dict[str, Any] = {"config": name, "H": size.hidden, "layers": size.layers, "seq": args.seq}
    for m in METHODS:
        ok = m in methods and m not in details["errors"] and times[m]
        med = common.median(times[m]) if ok else None
        details["median_step_ms"][m] = med
        details["step_ms_rounds"][m] = times[m] if m in methods else []
        row[f"{m}_tokens_per_s"] = tokens / (med / 1e3) if med else None
        row[f"{m}_peak_gib"] = peaks.get(m) if ok else None
        # the step's host (issue) time, next to its GPU time (median_step_ms)
        details["host_ms_per_step"][m] = hosts.get(m) if ok else None
        syncs, gpu_ops = issue.get(m, (None, None)) if ok else (None, None)
        details["syncs_per_step"][m], details["gpu_ops_per_step"][m] = syncs, gpu_ops
    issued = {m: details["host_ms_per_step"][m] for m in METHODS if m in methods}
    print(
        f"{name}: host ms to issue a step / GPU ms per step: "
        + ", ".join(
            f"{m} {h:.1f} / {details['median_step_ms'][m]:.1f} "
            f"({len(details['syncs_per_step'][m] or ())} syncs, "
            f"{details['gpu_ops_per_step'][m]} GPU ops)"
            for m, h in issued.items()
            if h and details["median_step_ms"][m]
        ),
        flush=True,
    )
    if "compile" in live and details["median_step_ms"].get("compile"):
        ratios = [c / k for c, k in zip(times["compile"], times.get("coda", []), strict=False)]
        details["coda_speedup_vs_compile_median_of_rounds"] = (
            common.median(ratios) if ratios and "coda" in live else None
        )
    live.clear()
    torch._dynamo.reset()
    _free()
    oom = [m for m, e in details["errors"].items() if "OutOfMemoryError" in e]
    if oom and mode == "interleaved":
        # four resident models did not fit after all: measure one model at a time
        print(f"{name}: out of memory with every model resident ({oom}); rerunning isolated")
        retry = argparse.Namespace(**{**vars(args), "mode": "isolated"})
        row, again = bench_config(name, size, retry, methods)
        again["interleaved_attempt_errors"] = details["errors"]
        return row, again
    return row, details


# ---- one decoder block -----------------------------------------------------------------


def _one_pass(
    call: Callable[[], torch.Tensor], inputs: list, dy: torch.Tensor, backward: bool
) -> Callable[[], Any]:
    """A callable running ``call`` once: with its backward to ``inputs`` (upstream
    gradient ``dy``), or forward only without autograd."""
    if backward:
        return lambda: torch.autograd.grad(call(), inputs, dy)

    def fwd() -> Any:
        with torch.no_grad():
            return call()

    return fwd


class Block:
    """One HF ``LlamaDecoderLayer`` of ``size`` on M tokens, its fused twin, the floor."""

    def __init__(self, size: LlamaSize, M: int) -> None:
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        from coda.fusions import rms_norm_stats
        from coda.nn import FusedLlamaDecoderLayer

        self.size, self.M = size, M
        config = size.config()
        g = generator(1)
        with torch.device(DEVICE):
            layer = LlamaDecoderLayer(config, layer_idx=0)
            rotary = LlamaRotaryEmbedding(config=config)
        with torch.no_grad():
            for p in layer.parameters():
                r = torch.randn(p.shape, device=DEVICE, generator=g)
                p.copy_(1 + 0.1 * r if p.dim() == 1 else r * p.shape[-1] ** -0.5)
        self.layer = layer.to(DTYPE).train()
        H = size.hidden
        self.x = torch.randn(1, M, H, device=DEVICE, generator=g).to(DTYPE).requires_grad_()
        self.positions = torch.arange(M, device=DEVICE)[None]
        with torch.no_grad():
            cos, sin = rotary(self.x, self.positions)
        self.cos_sin = (cos.to(DTYPE), sin.to(DTYPE))
        self.dy = torch.randn(1, M, H, device=DEVICE, generator=g).to(DTYPE)
        self.compiled = torch.compile(self.layer)
        # coda: the same weights in the fused layouts
        self.fused = FusedLlamaDecoderLayer.from_hf(self.layer, rotary).to(DEVICE, DTYPE).train()
        self.next_gamma = (1 + 0.1 * torch.randn(H, device=DEVICE, generator=g)).to(DTYPE)
        self.x2 = self.x.detach().view(M, H).clone().requires_grad_()
        with torch.no_grad():
            gamma = self.fused.norm_weight.detach()
            h, rstd = rms_norm_stats(self.x2.detach(), gamma, self.fused.eps)
        self.h, self.rstd = h, rstd
        self.dy2 = self.dy.view(M, H)

    # contenders: callables running one pass
    def hf(self, backward: bool) -> Callable[[], Any]:
        inputs = [self.x, *self.layer.parameters()]

        def call() -> torch.Tensor:
            out = self.compiled(
                self.x,
                attention_mask=None,
                position_ids=self.positions,
                position_embeddings=self.cos_sin,
            )
            return out[0] if isinstance(out, tuple) else out

        return _one_pass(call, inputs, self.dy, backward)

    def coda(self, backward: bool) -> Callable[[], Any]:
        from coda.fusions import NormedStream

        inputs = [self.x2, *self.fused.parameters()]

        def call() -> torch.Tensor:
            stream = NormedStream(self.x2, self.h, self.rstd)
            return self.fused(stream, self.positions, self.next_gamma, self.fused.eps).x

        return _one_pass(call, inputs, self.dy2, backward)

    def contenders(self) -> dict[str, Callable[[bool], Callable[[], Any]]]:
        """Name -> builder of one pass (``backward`` -> callable): the fused layer, the HF
        layer under torch.compile, and the two GEMM + SDPA floors."""
        return {
            "coda": self.coda,
            "compile": self.hf,
            "cublas_floor": functools.partial(self.floor, cublas_mm),
            "coda_floor": functools.partial(self.floor, coda_mm),
        }

    def floor(self, mm: Callable[[torch.Tensor, torch.Tensor], Any], backward: bool):
        s, M = self.size, self.M
        H, Fd, D = s.hidden, s.intermediate, s.hidden // s.heads
        g = generator(2)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=DEVICE, generator=g).to(DTYPE)

        ops = []
        for N, K in (((s.heads + 2 * s.kv_heads) * D, H), (H, s.heads * D), (2 * Fd, H), (H, Fd)):
            X, W, dY = rnd(M, K), rnd(N, K), rnd(M, N)
            ops.append((X, W))
            if backward:
                ops += [(dY, W.t()), (dY.t(), X.t())]
        q, k, v = (rnd(1, M, s.heads, D).transpose(1, 2) for _ in range(3))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        do = rnd(1, s.heads, M, D)

        def run() -> None:
            for A, B in ops:
                mm(A, B)
            if backward:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(o, (q, k, v), do)
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run


def cublas_mm(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return torch.mm(A, B.t())


def coda_mm(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``coda.gemm`` (A @ B.T) on CUDA; the fused ops' CPU stand-in on the CPU."""
    if not A.is_cuda:
        from coda.fusions._dispatch import matmul

        return matmul(A, B)
    from coda.matmul import gemm

    return gemm(A, B)


def bench_block(size: LlamaSize, M: int, args: argparse.Namespace, errors: list[str]) -> list[dict]:
    rows = []
    try:
        blk = Block(size, M)
    except Exception as exc:
        errors.append(f"block H={size.hidden}: {_short(exc)}")
        traceback.print_exc()
        return [
            {
                "H": size.hidden,
                "M": M,
                "pass": p,
                "coda_ms": None,
                "compile_ms": None,
                "cublas_floor_ms": None,
                "coda_floor_ms": None,
            }
            for p in ("fwd", "fwd+bwd")
        ]
    for pass_ in ("fwd", "fwd+bwd"):
        backward = pass_ == "fwd+bwd"
        fns: dict[str, Callable[[], Any]] = {}
        builders = blk.contenders()
        for key, build in builders.items():
            try:
                fn = build(backward)
                for _ in range(args.warmup + 1):
                    fn()
                sync()
                fns[key] = fn
            except Exception as exc:
                errors.append(f"block H={size.hidden} {pass_} {key}: {_short(exc)}")
                traceback.print_exc()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(args.rounds):
            for key in common.round_order(list(fns), r, args.rotate):
                try:
                    times[key].append(timed(fns[key], args.block_reps))
                except Exception as exc:
                    errors.append(f"block H={size.hidden} {pass_} {key}: {_short(exc)}")
                    fns.pop(key)
                    times.pop(key)
        row = {"H": size.hidden, "M": M, "pass": pass_}
        for key in ("coda", "compile", "cublas_floor", "coda_floor"):
            row[f"{key}_ms"] = common.median(times[key]) if times.get(key) else None
        rows.append(row)
    del blk, builders, fns
    torch._dynamo.reset()
    _free()
    return rows


# ---- output ----------------------------------------------------------------------------
def chart(rows: list[dict], block: list[dict], path: str, device: str) -> bool:
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no chart")
        return False
    panels = 3 if block else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4))
    colors = {
        "coda": "tab:blue",
        "eager": "tab:gray",
        "compile": "tab:orange",
        "liger": "tab:green",
    }
    width = 0.8 / len(METHODS)
    labels = [f"{r['config']}\nH={r['H']}, {r['layers']} layers, seq {r['seq']}" for r in rows]
    for ax, field, ylabel in (
        (axes[0], "tokens_per_s", "training tokens/s (higher is better)"),
        (axes[1], "peak_gib", "peak memory, GiB (lower is better)"),
    ):
        for j, m in enumerate(METHODS):
            xs = [i + (j - (len(METHODS) - 1) / 2) * width for i in range(len(rows))]
            ys = [r[f"{m}_{field}"] or 0.0 for r in rows]
            bars = ax.bar(xs, ys, width, label=m, color=colors[m])
            for b, r in zip(bars, rows, strict=True):
                if r[f"{m}_{field}"] is None:
                    ax.annotate(
                        "n/a",
                        (b.get_x() + b.get_width() / 2, 0),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        rotation=90,
                    )
        if field == "tokens_per_s":
            for i, r in enumerate(rows):
                c, k = r["coda_tokens_per_s"], r["compile_tokens_per_s"]
                if c and k:
                    ax.annotate(
                        f"coda/compile\n{c / k:.2f}x",
                        (i, max(c, k)),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[0].set_title("full training step (fwd + bwd + AdamW)", fontsize=10)
    axes[1].set_title("peak memory per method", fontsize=10)
    if block:
        ax = axes[2]
        keys = ("coda_ms", "compile_ms", "coda_floor_ms")
        bw = 0.8 / len(keys)
        names = [f"H={r['H']}\n{r['pass']}" for r in block]
        for j, key in enumerate(keys):
            xs = [i + (j - (len(keys) - 1) / 2) * bw for i in range(len(block))]
            ys = [
                (r[key] / r["cublas_floor_ms"]) if r[key] and r["cublas_floor_ms"] else 0.0
                for r in block
            ]
            ax.bar(xs, ys, bw, label=key.removesuffix("_ms"))
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(block)), names, fontsize=8)
        ax.set_ylabel("time / cuBLAS floor (GEMMs + SDPA)")
        ax.set_title(f"one decoder block, M={block[0]['M']} tokens", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"Hugging Face Llama training step, bf16, {device}", fontsize=11)
    common.save_figure(plt, fig, path)
    return True


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="llama3-1b,h4096-trunc")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seq", type=int, default=8192, help="sequence length (tokens per row)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers4096", type=int, default=2, help="layers of h4096-trunc")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=2, help="training steps per timed measurement")
    p.add_argument("--block-reps", type=int, default=10, help="block passes per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mode", choices=("auto", "interleaved", "isolated"), default="auto")
    p.add_argument("--quick", action="store_true", help="2 rounds, 1 rep, 2 warm-up steps")
    common.add_rotate_option(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-block", action="store_true", help="skip the one-block section")
    g.add_argument("--block-only", action="store_true", help="only the one-block section")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run of the harness (with --tiny)",
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes of both configs (smoke runs)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="parameter dtype; fp32 only for CPU smoke runs",
    )
    p.add_argument(
        "--amp",
        action="store_true",
        help="mixed precision: fp32 parameters, forwards under torch.autocast to bf16 "
        "(coda: apply_coda(..., fuse_autocast=True))",
    )
    p.add_argument(
        "--no-widen-gradients",
        action="store_true",
        help="coda.fusions._dispatch.WIDEN_GRADIENTS off (on by default: under --amp coda's "
        "large weight gradients widen to fp32 by a map pass instead of PyTorch's cast)",
    )
    p.add_argument(
        "--no-cast-pass",
        action="store_true",
        help="under --amp, the gate/up weights cast and interleaved by PyTorch's casts and "
        "copies instead of coda.fusions.cast_layouts' map passes",
    )
    p.add_argument(
        "--compile-hf-mask",
        action="store_true",
        help="the compiled model keeps transformers' causal-mask function (under dynamo "
        "before torch 2.14: an explicit mask, attention about 3x slower)",
    )
    p.add_argument("--out", default="benchmarks/results/train_step_h200.json")
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        default=None,
        help="run nothing: merge these result files (in order, later ones replacing rows of "
        "the same config / block (H, pass)) into --out and draw its PNG (works on a CPU)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge into an existing --out: replace its rows of the configs (and "
        "block rows of the hidden sizes) run now, keep the others",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.warmup, args.block_reps = 2, 1, 3, 3
    bad = [m for m in args.methods.split(",") if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {METHODS}")
    return args


def combine(paths: list[str], out: str) -> int:
    """``--combine``: merge result files (e.g. one per device run) into ``out`` + PNG."""
    import json

    with open(paths[0]) as f:
        payload = json.load(f)
    tmp = out + ".partial"
    for path in paths[1:]:
        with open(path) as f:
            new = json.load(f)
        common.write_json(tmp, payload)
        payload = merged(tmp, new)
        os.remove(tmp)
    common.write_json(out, payload)
    chart(payload["rows"], payload["block"], os.path.splitext(out)[0] + ".png", payload["device"])
    print(f"wrote {out} from {len(paths)} files")
    return 0


def merged(path: str, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` merged into the JSON at ``path``: rows/details by config and block rows by
    (H, pass) from ``new`` replace the old ones; the commands are kept as a list."""
    import json

    with open(path) as f:
        old = json.load(f)
    out = dict(new)
    configs_now = {r["config"] for r in new["rows"]}
    out["rows"] = [r for r in old.get("rows", []) if r["config"] not in configs_now] + new["rows"]
    out["details"] = [
        d for d in old.get("details", []) if d.get("config") not in configs_now
    ] + new["details"]
    blocks_now = {(r["H"], r["pass"]) for r in new["block"]}
    out["block"] = sorted(
        [r for r in old.get("block", []) if (r["H"], r["pass"]) not in blocks_now] + new["block"],
        key=lambda r: (r["H"], r["pass"]),
    )
    out["errors"] = old.get("errors", []) + new["errors"]
    commands = old.get("commands", [old.get("command")])
    out["commands"] = [c for c in commands if c] + [new["command"]]
    return out


def environment() -> dict[str, Any]:
    if DEVICE == "cuda":
        env = common.environment()
    else:
        import platform

        env = {
            "device": f"CPU ({platform.machine()}, {os.cpu_count()} cores): smoke run",
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        }
    try:
        from importlib.metadata import version

        env["versions"]["transformers"] = version("transformers")
    except Exception:
        env["versions"]["transformers"] = None
    env["versions"]["liger_kernel"] = liger_version()
    return env


def main(argv: list[str] | None = None) -> int:
    global DEVICE, DTYPE, AMP, COMPILE_HF_MASK
    args = parse(argv)
    if args.combine:
        return combine(args.combine, args.out)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "train_step.py needs a CUDA GPU (an H100/H200 for coda's kernels); "
            "--device cpu --tiny runs a smoke test of the harness",
            file=sys.stderr,
        )
        return 2
    DEVICE = args.device
    DTYPE = torch.float32 if args.dtype == "fp32" or args.amp else BF16
    AMP = args.amp
    COMPILE_HF_MASK = args.compile_hf_mask
    from coda.fusions import _dispatch, cast_layouts

    if args.no_widen_gradients:
        _dispatch.WIDEN_GRADIENTS = False
    if args.no_cast_pass:
        cast_layouts.MIN_NUMEL = sys.maxsize
    all_configs = configs(args.layers4096, args.tiny)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in all_configs]
    if unknown:
        print(f"unknown configs {unknown}; choose from {list(all_configs)}", file=sys.stderr)
        return 2
    methods = list(args.methods.split(","))
    env = environment()
    rows, details, block, errors = [], [], [], []
    if not args.block_only:
        for name in names:
            try:
                row, det = bench_config(name, all_configs[name], args, methods)
            except Exception as exc:  # the config itself (building the model) failed
                traceback.print_exc()
                errors.append(f"{name}: {_short(exc)}")
                row = {
                    "config": name,
                    "H": all_configs[name].hidden,
                    "layers": all_configs[name].layers,
                    "seq": args.seq,
                }
                row.update({f: None for f in ROW_FIELDS if f not in row})
                det = {"config": name, "errors": {"config": _short(exc)}}
                torch._dynamo.reset()
                _free()
            rows.append({f: row[f] for f in ROW_FIELDS})
            details.append(det)
            errors += [f"{name} {m}: {e}" for m, e in det.get("errors", {}).items()]
    if not args.no_block:
        M = args.batch * args.seq
        for _, size in sorted({all_configs[n].hidden: all_configs[n] for n in names}.items()):
            block += bench_block(size, M, args, errors)
    payload = {
        **env,
        "dtype": str(DTYPE).removeprefix("torch."),
        "amp": AMP,
        "tiny": args.tiny,
        "protocol": (
            f"interleaved rounds ({args.rounds}) of {args.reps} step(s) per method "
            f"after {args.warmup} warm-up steps; median over rounds; CUDA events"
        ),
        "compile_causal_mask": "transformers" if COMPILE_HF_MASK else "as_eager",
        "widen_gradients": _dispatch.WIDEN_GRADIENTS,
        "cast_pass": not args.no_cast_pass,
        "rows": rows,
        "details": details,
        "block": block,
        "errors": errors,
    }
    if args.merge and os.path.exists(args.out):
        payload = merged(args.out, payload)
    common.write_json(args.out, payload)
    rows, block, errors = payload["rows"], payload["block"], payload["errors"]
    chart(rows, block, os.path.splitext(args.out)[0] + ".png", env["device"])

    def table(rs: list[dict], cols: list[str]) -> None:
        if rs:
            common.print_table(
                [{k: ("-" if v is None else v) for k, v in r.items()} for r in rs], cols
            )

    table(rows, list(ROW_FIELDS))
    table(block, ["H", "M", "pass", "coda_ms", "compile_ms", "cublas_floor_ms", "coda_floor_ms"])
    for e in errors:
        print(f"error: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
