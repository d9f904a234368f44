"""tests/gpu_shards.py, the sharded GPU test runner, run on CPU: its log parsing, its
dealing, and a whole run over a small test file of its own (a pass, a failure, a skip,
an id with spaces)."""

from __future__ import annotations

import pytest

import gpu_shards  # tests/ is on sys.path, as for tests/_hopper.py

LOG = """\
============================= test session starts ==============================
tests/test_a_gpu.py::test_one[x-1] PASSED [ 10%]
tests/test_a_gpu.py::test_cfg[GemmConfig(tile_m=128, tile_n=192)] PASSED [ 20%]
tests/test_a_gpu.py::test_two SKIPPED (needs more) [ 30%]
tests/test_b_gpu.py::test_three FAILED [ 40%]
tests/test_b_gpu.py::test_four rc 124
"""


def test_outcomes_read_ids_with_spaces_and_skip_cut_lines():
    got = gpu_shards.outcomes(LOG.splitlines())
    assert got == {
        "tests/test_a_gpu.py::test_one[x-1]": "PASSED",
        "tests/test_a_gpu.py::test_cfg[GemmConfig(tile_m=128, tile_n=192)]": "PASSED",
        "tests/test_a_gpu.py::test_two": "SKIPPED",
        "tests/test_b_gpu.py::test_three": "FAILED",
    }


TIMED = """\
tests/test_a_gpu.py::test_one[x-1] PASSED                                    182.0us
tests/test_a_gpu.py::test_cfg[GemmConfig(tile_m=128, tile_n=192)] PASSED     200.9ms
tests/test_a_gpu.py::test_two SKIPPED (needs more)                            12.50s
tests/test_b_gpu.py::test_three FAILED                                        3m 5s
tests/test_b_gpu.py::test_four PASSED                                         1h 2m
tests/test_b_gpu.py::test_five[3s] PASSED [ 90%]
"""


def test_durations_read_every_unit_and_skip_lines_without_one():
    got = gpu_shards.durations(TIMED.splitlines())
    assert got == pytest.approx(
        {
            "tests/test_a_gpu.py::test_one[x-1]": 182e-6,
            "tests/test_a_gpu.py::test_cfg[GemmConfig(tile_m=128, tile_n=192)]": 0.2009,
            "tests/test_a_gpu.py::test_two": 12.5,
            "tests/test_b_gpu.py::test_three": 185.0,
            "tests/test_b_gpu.py::test_four": 3720.0,
        }
    )
    ids = list(gpu_shards.outcomes(TIMED.splitlines()))
    text = gpu_shards.summarize(ids, gpu_shards.outcomes(TIMED.splitlines()), [0], got)
    assert "  tests/test_b_gpu.py: 3905 s" in text
    assert text.split("slowest:\n")[1].startswith("   3720.0 s  tests/test_b_gpu.py::test_four")


def test_settled_takes_passed_and_skipped_from_every_log(tmp_path):
    (tmp_path / "a.log").write_text(LOG)
    (tmp_path / "b.log").write_text("tests/test_b_gpu.py::test_three PASSED [100%]\n")
    assert gpu_shards.settled([str(tmp_path / "a.log")]) == {
        "tests/test_a_gpu.py::test_one[x-1]",
        "tests/test_a_gpu.py::test_cfg[GemmConfig(tile_m=128, tile_n=192)]",
        "tests/test_a_gpu.py::test_two",
    }
    both = gpu_shards.settled([str(tmp_path / "a.log"), str(tmp_path / "b.log")])
    assert "tests/test_b_gpu.py::test_three" in both


@pytest.mark.parametrize("n,procs", [(0, 4), (3, 4), (10, 3), (12, 12)])
def test_deal_covers_every_id_once_in_even_shards(n, procs):
    ids = [f"t::{i}" for i in range(n)]
    shards = gpu_shards.deal(ids, procs)
    assert sorted(i for s in shards for i in s) == sorted(ids)
    assert len(shards) == min(n, procs) and all(shards)
    if shards:
        assert max(map(len, shards)) - min(map(len, shards)) <= 1


SAMPLE = """
import pytest

@pytest.mark.parametrize("cfg", ["a b", "c"])
def test_pass(cfg):
    assert True

def test_fail():
    assert 1 == 2

def test_skip():
    pytest.skip("not here")
"""


def test_a_whole_run_then_a_continuation(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_sample_gpu.py").write_text(SAMPLE)
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "first"
    rc = gpu_shards.main(["--procs", "2", "--timeout", "120", "--out", str(first),
                          "test_sample_gpu.py"])  # fmt: skip
    assert rc == 1  # a test failed
    summary = (first / "summary.txt").read_text()
    assert "outcomes: 1 FAILED, 2 PASSED, 1 SKIPPED" in summary
    assert "test_sample_gpu.py::test_fail" in summary.split("failed:")[1]
    assert "test seconds (summed over processes):\n  test_sample_gpu.py: " in summary
    assert sorted(p.name for p in first.glob("shard_*.log")) == ["shard_00.log", "shard_01.log"]
    # the next call runs only what did not pass or skip
    second = tmp_path / "second"
    rc = gpu_shards.main(["--procs", "4", "--timeout", "120", "--out", str(second),
                          "--done", str(first / "shard_*.log"), "test_sample_gpu.py"])  # fmt: skip
    assert rc == 1
    assert (second / "summary.txt").read_text().startswith("outcomes: 1 FAILED\n")
    assert list(second.glob("shard_*.ids")) == [second / "shard_00.ids"]
    assert "outcomes:" in capsys.readouterr().out


CACHE_SAMPLE = """
import os

import pytest

@pytest.mark.parametrize("i", range(4))
def test_cache(i):
    with open(f"cache_{os.getpid()}.txt", "w") as f:
        f.write(os.environ["CODA_CACHE_DIR"])
"""


@pytest.mark.parametrize("own", [False, True])
def test_processes_share_one_kernel_cache_unless_asked(tmp_path, monkeypatch, own):
    (tmp_path / "test_cache_gpu.py").write_text(CACHE_SAMPLE)
    monkeypatch.chdir(tmp_path)
    cache = str(tmp_path / "kcache")
    args = ["--procs", "2", "--timeout", "120", "--out", str(tmp_path / "o"), "--cache-dir", cache]
    assert gpu_shards.main(args + (["--own-caches"] if own else []) + ["test_cache_gpu.py"]) == 0
    seen = sorted(p.read_text() for p in tmp_path.glob("cache_*.txt"))
    assert seen == ([f"{cache}-00", f"{cache}-01"] if own else [cache, cache])
