"""Run ``sanitize_gemm.py`` under compute-sanitizer in every layout at once and write one
JSON summary (the driver behind ``results/sanitize_*_h200.json``).

    python benchmarks/sanitize_report.py [--tools values,memcheck,racecheck]
        [--layouts fwd,dgrad,wgrad,mk] [--sections few_buffers,split_wide,...]
        [--args=--split-wide-only] [--timeout 540] [--jobs 16] [--logs DIR]
        --out results.json

Each (layout, tool) is one process (with ``--sections``, each (section, layout, tool):
the map pass once; rows then carry ``section``), sharing one ``CODA_CACHE_DIR``: the ``values``
processes (every layout at once) first, compiling every kernel into it, then the
sanitized ones together, which load them. ``values`` runs the script plainly (its own
float64 checks), ``memcheck`` / ``racecheck`` under ``compute-sanitizer
--report-api-errors no --tool T`` (the API errors it would report come from
cuda-python's driver look-ups, not from coda). Rows
``{"tool", "layout", "rc", "values_match_float64", "errors", "hazards_displayed",
"hazard_kernels", "hazards_in_coda_kernels", "seconds"}`` (``errors`` for memcheck, the
hazard fields for racecheck; ``rc`` 124 when the process ran past ``--timeout``;
``values_match_float64``: the script's checks held, which are float64 comparisons in its
few-buffer and split-K / wide-tile sections and finiteness and the plain GEMM's error in
the others). ``--jobs`` caps the processes at once (default 16).
``hazards_displayed`` is the tool's summary count; ``hazards_in_coda_kernels`` counts the
reported accesses (each "access at" line of a hazard report: a hazard names two or more)
whose kernel is not PyTorch's or cuBLAS's (``hazard_kernel_is_foreign``), so it is zero
exactly when no displayed hazard touches coda's kernels. The script computes its
references on the CPU, so that the GPU runs coda's kernels (and PyTorch's fills and
copies) alone: racecheck flags cuBLAS's GEMM kernels by the thousand and runs them
slowly, and leaving them uninstrumented (``--kernel-name-exclude kns=nvjet``,
compute-sanitizer 2025.3.1) made the tool fail ("Internal Sanitizer Error: The Sanitizer
failed to handle a hardware exception") on the H200, in every layout.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sanitize_gemm.py")
LAYOUTS = ("fwd", "dgrad", "wgrad", "mk")
#: kernels the script launches that are not coda's (its eager baselines and torch ops)
FOREIGN_PREFIXES = ("nvjet", "sm90_xmma", "cutlass_80", "ampere", "at::", "void at::")

_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) error")
_HAZARDS = re.compile(r"RACECHECK SUMMARY: (\d+) hazard")
#: a hazard's kernel: "access at 0x... in KERNEL" or "access at KERNEL+0x..." (newer tools)
_HAZARD_KERNEL = re.compile(
    r"access at (?:\S+ in (.+?)(?: \[\d+ hazards?\])?$|(\S+?)\+0x[0-9a-fA-F]+)"
)


def hazard_kernel_is_foreign(name: str) -> bool:
    """Whether a racecheck hazard's kernel is PyTorch's or cuBLAS's, not coda's."""
    name = name.strip()
    return name.startswith(FOREIGN_PREFIXES) or "at::native" in name or "cublas" in name


def _hazard_kernel(line: str) -> str | None:
    m = _HAZARD_KERNEL.search(line)
    return None if m is None else (m.group(1) or m.group(2)).strip()


def summarize(
    tool: str, layout: str, rc: int, log: str, seconds: float, section: str | None = None
) -> dict:
    """One row from a finished process's combined output (``section``: the script's
    section it ran, None for the whole script)."""
    row: dict = {
        "tool": tool,
        "layout": layout,
        **({} if section is None else {"section": section}),
        "rc": rc,
        # the script's own checks held (a clean exit): outputs against float64 in the
        # few-buffer and split-K / wide-tile sections, finite outputs and the plain
        # GEMM's error in the others
        "values_match_float64": rc == 0,
        "seconds": round(seconds, 1),
    }
    if tool == "memcheck":
        found = _ERRORS.findall(log)
        row["errors"] = int(found[-1]) if found else None
    if tool == "racecheck":
        found = _HAZARDS.findall(log)
        named = [_hazard_kernel(line) for line in log.splitlines()]
        named = [k for k in named if k is not None]
        row["hazards_displayed"] = int(found[-1]) if found else None
        row["hazard_kernels"] = sorted(set(named))
        # reported accesses (not hazards) in coda's kernels: zero iff none touches them
        row["hazards_in_coda_kernels"] = sum(not hazard_kernel_is_foreign(k) for k in named)
    return row


def command(tool: str, layout: str, extra: list[str], section: str | None = None) -> list[str]:
    """The process for one (tool, layout[, section of sanitize_gemm.py])."""
    run = [sys.executable, SCRIPT, f"--layout={layout}", *extra]
    if section is not None:
        run.insert(2, f"--sections={section}")
    if tool == "values":
        return run
    return ["compute-sanitizer", "--report-api-errors", "no", "--tool", tool, *run]


def jobs_for(tools: list[str], layouts: list[str], sections: list[str] | None) -> list[tuple]:
    """(tool, layout, section) per process: every section in every layout (the map pass,
    which has no layout, once), or the whole script per layout (section None)."""
    if not sections:
        return [(t, lay, None) for lay in layouts for t in tools]
    jobs = []
    for section in sections:
        for lay in layouts[:1] if section == "map" else layouts:
            jobs += [(t, lay, section) for t in tools]
    return jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tools", default="values,memcheck,racecheck")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument(
        "--sections",
        default="",
        help="comma list of sanitize_gemm.py sections, each its own process per layout "
        "(default: the whole script per layout)",
    )
    p.add_argument("--args", default="", help="extra arguments for sanitize_gemm.py")
    p.add_argument("--timeout", type=float, default=540.0)
    p.add_argument("--jobs", type=int, default=16, help="processes at once, at most")
    p.add_argument("--logs", default=None, help="keep each process's output here")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    extra = args.args.split()
    sections = [x for x in args.sections.split(",") if x]
    jobs = jobs_for(args.tools.split(","), args.layouts.split(","), sections)
    logs = args.logs or tempfile.mkdtemp(prefix="sanitize-logs-")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("CODA_CACHE_DIR", tempfile.mkdtemp(prefix="sanitize-cache-"))

    def run(job):
        tool, layout, section = job
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command(tool, layout, extra, section),
                capture_output=True,
                text=True,
                env=env,
                timeout=args.timeout,
            )
            rc, log = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            log = "".join(
                x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)
            )
        name = "_".join(x for x in (tool, section, layout) if x)
        with open(os.path.join(logs, f"{name}.log"), "w") as f:
            f.write(log)
        return summarize(tool, layout, rc, log, time.perf_counter() - start, section)

    # the plain runs first, all layouts at once: they compile every kernel into the
    # shared cache, so the sanitized runs after them only load kernels
    plain = [j for j in jobs if j[0] == "values"]
    sanitized = [j for j in jobs if j[0] != "values"]
    rows = []
    for batch in (plain, sanitized):
        if batch:
            with ThreadPoolExecutor(min(len(batch), args.jobs)) as pool:
                rows += list(pool.map(run, batch))
    for row in rows:
        print(row)
    payload = {
        **common.environment(),
        "command": "python3 " + " ".join(sys.argv),
        "script_args": extra,
        "rows": rows,
    }
    common.write_json(args.out, payload)


if __name__ == "__main__":
    main()
