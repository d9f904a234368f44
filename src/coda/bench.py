"""coda.bench: ``python -m coda bench``, the benchmark families run one after another.

A tool over the whole library (beside ``coda.demo``; only ``coda.__main__`` imports it).
The benchmark scripts live in the repository's ``benchmarks/`` folder, which is not part
of the installed package: ``find_benchmarks`` looks for it next to the source tree
(``src/coda/../../benchmarks``, what an editable install or a checkout has), then in the
current directory, unless ``--benchmarks DIR`` or ``$CODA_BENCHMARKS`` names it.

Each family is its script run in a child process (``python benchmarks/<family>.py --out
DIR/<family>_<gpu>.json``, plus the family's short options with ``--quick``), its output
captured in ``DIR/logs/<family>.log``; a progress bar (tqdm's, else a text bar) advances
per family. Every family writes its JSON; the scripts that draw no chart of their own
(``epilogue_overhead``, ``launch_overhead``) get one drawn here from their JSON. The
families need a CUDA GPU (Hopper for coda's kernels): on a machine without one the
command prints so and exits with status 2 (the CPU smoke runs are
``python benchmarks/train_loss.py --device cpu --steps 5`` and
``python benchmarks/train_step.py --device cpu --tiny --quick``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FAMILIES", "Family", "device_tag", "find_benchmarks", "run_families"]


@dataclass(frozen=True)
class Family:
    """One benchmark script: its name (``benchmarks/<name>.py``), what it measures, and
    the options ``--quick`` adds (a shorter run of the same measurement)."""

    name: str
    what: str
    quick: tuple[str, ...]
    draws_chart: bool = True


FAMILIES: tuple[Family, ...] = (
    Family("gemm", "coda.gemm vs cuBLAS, every operand layout", ("--rounds", "2", "--H", "2048")),
    Family(
        "epilogue_overhead",
        "fused epilogues vs coda's plain GEMM",
        ("--rounds", "2", "--sizes", "4096", "--layouts", "fwd"),
        draws_chart=False,
    ),
    Family(
        "launch_overhead",
        "host time per call vs eager PyTorch",
        ("--rounds", "3", "--calls", "100"),
        draws_chart=False,
    ),
    Family(
        "patterns",
        "Llama-block patterns vs eager, torch.compile, Liger, the GEMM floor",
        ("--H", "2048", "--rounds", "2"),
    ),
    Family(
        "cross_entropy",
        "LM head + cross-entropy vs eager, torch.compile, Liger, CCE",
        ("--H", "2048", "--M", "8192", "--rounds", "2"),
    ),
    Family(
        "train_step",
        "HF Llama training step vs eager, torch.compile, Liger; one block vs its floor",
        ("--quick",),
    ),
    Family("train_loss", "coda vs eager training-loss curves (200 steps, bf16)", ("--quick",)),
)


def find_benchmarks(explicit: str | None = None) -> Path | None:
    """The ``benchmarks/`` folder: ``explicit``, ``$CODA_BENCHMARKS``, the checkout this
    package was installed from, or ``./benchmarks``; None when none holds a script."""
    here = Path(__file__).resolve()
    candidates = [explicit, os.environ.get("CODA_BENCHMARKS")]
    candidates += [str(here.parents[2] / "benchmarks"), str(Path.cwd() / "benchmarks")]
    for c in candidates:
        if c and (Path(c) / "common.py").is_file():
            return Path(c).resolve()
    return None


def device_tag(name: str) -> str:
    """'h200' for 'NVIDIA H200', 'h100' for 'NVIDIA H100 80GB HBM3', else 'gpu'."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", name)
    return m.group(1).lower() if m else "gpu"


def _progress(total: int) -> tuple[Callable[[str], None], Callable[[], None], Callable[[], None]]:
    """(describe, advance, close) of a progress bar over ``total`` families."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="family", dynamic_ncols=True)
        return bar.set_description, lambda: bar.update(1), bar.close
    state = {"done": 0, "desc": ""}

    def show() -> None:
        done = state["done"]
        filled = round(20 * done / max(total, 1))
        print(
            f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} {state['desc']}",
            file=sys.stderr,
            flush=True,
        )

    def describe(text: str) -> None:
        state["desc"] = text
        show()

    def advance() -> None:
        state["done"] += 1

    return describe, advance, lambda: show()


def fallback_chart(family: str, json_path: Path, png_path: Path) -> bool:
    """A bar chart from the JSON of a family that draws none; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(json_path.read_text())
    rows = data.get("rows", [])
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(rows)), 4.5))
    if family == "epilogue_overhead":
        labels = [f"{r['epilogue']} {r['layout']} N={r['N']}" for r in rows]
        ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("fused / plain GEMM time")
    else:  # launch_overhead
        labels = [f"{r['name']} {'x'.join(map(str, r['shape']))}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["coda_us"] for r in rows], 0.4, label="coda")
        ax.bar([x + 0.2 for x in xs], [r["eager_us"] for r in rows], 0.4, label="eager")
        ax.set_ylabel("host time per call (us)")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
    ax.set_title(f"{family}, {data.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return True


def run_families(
    names: Sequence[str],
    out: Path,
    benchmarks: Path,
    tag: str,
    quick: bool,
    emit: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Run each named family's script; returns per family its status, seconds, files."""
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    families = {f.name: f for f in FAMILIES}
    results: dict[str, dict] = {}
    describe, advance, close = _progress(len(names))
    try:
        for name in names:
            fam = families[name]
            describe(name)
            json_path = out / f"{name}_{tag}.json"
            png_path = json_path.with_suffix(".png")
            log_path = logs / f"{name}.log"
            cmd = [sys.executable, str(benchmarks / f"{name}.py"), "--out", str(json_path)]
            cmd += list(fam.quick) if quick else []
            t0 = time.perf_counter()
            with open(log_path, "w") as log:
                log.write("$ " + " ".join(cmd) + "\n")
                log.flush()
                rc = subprocess.run(
                    cmd, cwd=benchmarks.parent, stdout=log, stderr=subprocess.STDOUT
                ).returncode
            seconds = time.perf_counter() - t0
            if rc == 0 and json_path.is_file() and not fam.draws_chart:
                fallback_chart(name, json_path, png_path)
            files = [str(p) for p in (json_path, png_path) if p.is_file()]
            results[name] = {
                "returncode": rc,
                "seconds": seconds,
                "files": files,
                "log": str(log_path),
            }
            advance()
            status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            emit(f"{name}: {status} in {seconds:.0f} s; wrote {', '.join(files) or 'nothing'}")
            if rc != 0:
                tail = log_path.read_text().splitlines()[-15:]
                emit("\n".join(f"    {line}" for line in tail))
    finally:
        close()
    return results
