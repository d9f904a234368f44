"""Run GPU test files as parallel pytest processes within one device call.

A developer tool for the lent GPU machine (``../shared/device/README.md``), not a test
module: most of a GPU test's time is CuTeDSL compiling its kernels on one CPU core, so
one process runs a few hundred tests in a 10-minute call while the machine has 16
cores. This collects the test ids, drops those that earlier logs show passed or skipped
(``--done``: a call cut by its time limit continues in the next), deals the rest round
robin to ``--procs`` processes sharing one kernel cache (``--cache-dir``: a kernel one
process compiled is loaded, not compiled again, by every later test that needs it; the
disk cache takes concurrent writers; ``--own-caches`` gives each process its own, as
before 2026-11-29), runs them under ``--timeout``, and writes to ``--out``:

* ``shard_NN.log``: each process's ``pytest -v`` output (the ``--done`` input of the next
  call), ``shard_NN.ids`` its ids;
* ``summary.txt``: counts per outcome and per file, the seconds each file's tests took
  (``console_output_style=times``, summed over the processes) and the slowest ids, the
  failed ids, the ids not run.

    python tests/gpu_shards.py --procs 12 --timeout 540 --out $OUT [--done OLD.log ...]
        [--] [pytest paths and options; default: tests/*_gpu.py]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

#: the kernel cache every process shares (``--cache-dir``): on a warm machine a later call
#: finds the kernels of the calls before it
SHARED_CACHE = "/tmp/coda-kcache-shared"

#: the outcome word ``pytest -v`` prints after a test id
OUTCOME = re.compile(r"^(?P<id>\S.*?::.*?) (?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def outcomes(lines: list[str]) -> dict[str, str]:
    """{test id: outcome} of ``pytest -v`` output lines (ids may contain spaces; the last
    outcome of an id wins)."""
    found: dict[str, str] = {}
    for line in lines:
        got = OUTCOME.match(line)
        if got:
            found[got["id"]] = got["outcome"]
    return found


#: the duration ``console_output_style=times`` prints at the end of an outcome line:
#: "182.0us", "200.9ms", "12.34s", "3m 5s", "1h 2m"
DURATION = re.compile(
    r"(?:(?P<h>\d+)h (?P<hm>\d+)m|(?P<m>\d+)m (?P<ms>\d+)s|(?P<v>[\d.]+)(?P<unit>us|ms|s))\s*$"
)
UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def durations(lines: list[str]) -> dict[str, float]:
    """{test id: seconds} from the outcome lines of a log written with
    ``console_output_style=times`` (lines without a duration are left out)."""
    found: dict[str, float] = {}
    for line in lines:
        got, took = OUTCOME.match(line), DURATION.search(line)
        if not (got and took):
            continue
        if took["h"]:
            found[got["id"]] = 3600 * int(took["h"]) + 60 * int(took["hm"])
        elif took["m"]:
            found[got["id"]] = 60 * int(took["m"]) + int(took["ms"])
        else:
            found[got["id"]] = float(took["v"]) * UNIT_SECONDS[took["unit"]]
    return found


def settled(logs: list[str]) -> set[str]:
    """The ids that passed or were skipped in these ``pytest -v`` logs."""
    done: set[str] = set()
    for path in logs:
        lines = Path(path).read_text(errors="replace").splitlines()
        done |= {i for i, o in outcomes(lines).items() if o in ("PASSED", "SKIPPED", "XFAIL")}
    return done


def deal(ids: list[str], procs: int) -> list[list[str]]:
    """``ids`` dealt round robin to at most ``procs`` non-empty shards (neighbouring ids
    often share kernels, but they also share their cost: dealing evens the shards)."""
    shards = [ids[i::procs] for i in range(max(1, procs))]
    return [s for s in shards if s]


def collect(args: list[str]) -> list[str]:
    """The test ids ``pytest --collect-only -q`` lists for ``args``."""
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:logging", "-q", "--collect-only", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    return [line.strip() for line in got.stdout.splitlines() if "::" in line]


def summarize(
    ids: list[str], found: dict[str, str], rcs: list[int], took: dict[str, float] | None = None
) -> str:
    """The summary text: outcomes, per file, seconds per file and the slowest ids (from
    ``took``, {id: seconds}), failures, ids not run, shard exit codes."""
    counts = Counter(found.get(i, "NOT RUN") for i in ids)
    per_file = Counter((i.split("::")[0], found.get(i, "NOT RUN")) for i in ids)
    lines = ["outcomes: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))]
    lines += [f"  {f}: {n} {o}" for (f, o), n in sorted(per_file.items())]
    wanted = set(ids)
    took = {i: t for i, t in (took or {}).items() if i in wanted}
    if took:
        seconds = Counter()
        for i, t in took.items():
            seconds[i.split("::")[0]] += t
        lines += ["test seconds (summed over processes):"]
        lines += [f"  {f}: {t:.0f} s" for f, t in sorted(seconds.items())]
        lines += ["slowest:"]
        lines += [f"  {t:7.1f} s  {i}" for i, t in sorted(took.items(), key=lambda x: -x[1])[:10]]
    lines += ["shard exit codes: " + " ".join(map(str, rcs)) + " (124: cut by --timeout)"]
    bad = [i for i in ids if found.get(i) in ("FAILED", "ERROR")]
    lines += ["failed:"] + [f"  {i}" for i in bad]
    lines += ["not run:"] + [f"  {i}" for i in ids if i not in found]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=12)
    p.add_argument("--timeout", type=int, default=540, help="seconds per process")
    p.add_argument("--out", required=True, help="folder for the logs and the summary")
    p.add_argument("--done", nargs="*", default=[], help="earlier pytest -v logs (globs)")
    p.add_argument("--cache-dir", default=SHARED_CACHE, help="the processes' kernel cache")
    p.add_argument(
        "--own-caches", action="store_true", help="a kernel cache per process (CACHE-DIR-NN)"
    )
    p.add_argument("pytest_args", nargs="*", help="paths and options for pytest")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    targets = args.pytest_args or sorted(glob.glob("tests/*_gpu.py"))
    done = settled([f for pattern in args.done for f in sorted(glob.glob(pattern))])
    ids = [i for i in collect(targets) if i not in done]
    shards = deal(ids, args.procs)
    running = []
    for n, shard in enumerate(shards):
        (out / f"shard_{n:02d}.ids").write_text("\n".join(shard) + "\n")
        cache = f"{args.cache_dir}-{n:02d}" if args.own_caches else args.cache_dir
        env = {**os.environ, "CODA_CACHE_DIR": cache}
        log = open(out / f"shard_{n:02d}.log", "w")  # noqa: SIM115 (closed below)
        cmd = ["timeout", str(args.timeout), sys.executable, "-m", "pytest", "-p", "no:logging"]
        cmd += ["-p", "no:cacheprovider", "-v", "--tb=short", "-o", "console_output_style=times"]
        cmd += [f"@{out / f'shard_{n:02d}.ids'}"]
        running.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    rcs = []
    for proc, log in running:
        rcs.append(proc.wait())
        log.close()
    found: dict[str, str] = {}
    took: dict[str, float] = {}
    for n in range(len(shards)):
        lines = (out / f"shard_{n:02d}.log").read_text(errors="replace").splitlines()
        found.update(outcomes(lines))
        took.update(durations(lines))
    text = summarize(ids, found, rcs, took)
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 1 if any(found.get(i) in ("FAILED", "ERROR") for i in ids) else 0


if __name__ == "__main__":
    sys.exit(main())
