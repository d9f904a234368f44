"""CPU checks of the benchmark plumbing added for fair A/Bs (``benchmarks/common.py``,
``gemm.py``, ``gemm_configs.py``): the rotated round order of ``common.interleaved``,
the argument helpers of the parallel precompile, and the shapes the GEMM scripts time."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
common = pytest.importorskip("common")
gemm_bench = pytest.importorskip("gemm")
gemm_configs = pytest.importorskip("gemm_configs")


def _order(monkeypatch, names, rounds, rotate):
    """The sequence in which ``common.interleaved`` times its contenders (warm-up calls
    excluded), with the CUDA timing replaced by a recorder."""
    seen = []
    monkeypatch.setattr(common, "time_once", lambda fn, reps: seen.append(fn()) or 1.0)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    contenders = {n: (lambda n=n: n) for n in names}
    times = common.interleaved(contenders, rounds=rounds, reps=1, warmup=0, rotate=rotate)
    assert {n: len(v) for n, v in times.items()} == {n: rounds for n in names}
    return seen


def test_fixed_order_repeats_the_same_round(monkeypatch):
    assert _order(monkeypatch, "abc", 2, rotate=False) == list("abcabc")


def test_rotated_rounds_put_every_contender_in_every_place(monkeypatch):
    seen = _order(monkeypatch, "abc", 6, rotate=True)
    rounds = [seen[i : i + 3] for i in range(0, 18, 3)]
    assert rounds[:3] == [list("abc"), list("bca"), list("cab")]
    for place in range(3):  # over a multiple of 3 rounds, each name twice in each place
        assert sorted(r[place] for r in rounds) == sorted("aabbcc")
    # two contenders: A B, B A, ... (each follows the other and itself equally often)
    assert _order(monkeypatch, "ab", 4, rotate=True) == list("abbaabba")


def test_round_order_is_what_the_step_and_block_loops_run():
    # train_step.py's step rounds and block section take their order from round_order
    assert [common.round_order(list("abcd"), r, True) for r in range(5)] == [
        list("abcd"),
        list("bcda"),
        list("cdab"),
        list("dabc"),
        list("abcd"),
    ]
    assert common.round_order(list("abcd"), 3, False) == list("abcd")
    assert common.round_order([], 1, True) == []


def test_without_option_drops_the_option_and_its_value():
    argv = ["--rounds", "3", "--precompile", "14", "--rotate", "--precompile=2", "--x"]
    assert common.without_option(argv, "--precompile") == ["--rounds", "3", "--rotate", "--x"]
    assert common.without_option(["--precompiled", "1"], "--precompile") == ["--precompiled", "1"]


def test_llama_gemm_shapes_take_tokens_and_ffn_widths():
    assert gemm_bench.ffn_sizes("2048:8192,4096:14336") == {2048: 8192, 4096: 14336}
    assert gemm_bench.ffn_sizes("") == {}
    proj = gemm_bench.llama_projections(4096, 14336)
    assert proj["gate_up"] == (2 * 14336, 4096) and proj["down"] == (4096, 14336)
    assert gemm_bench.llama_projections(4096)["down"] == (4096, 11008)  # round_up(8H/3, 256)
    out_f, in_f = proj["down"]
    assert gemm_bench.layout_shape("fwd", out_f, in_f, 8192) == (8192, 4096, 14336)
    assert gemm_bench.layout_shape("dgrad", out_f, in_f, 8192) == (8192, 14336, 4096)
    assert gemm_bench.layout_shape("wgrad", out_f, in_f, 8192) == (4096, 14336, 8192)
    assert gemm_bench.layout_shape("wgrad", out_f, in_f) == (4096, 14336, 16384)


def _args(**kw):
    base = dict(layouts="fwd", H="", tokens=16384, ffn="", shapes="")
    return argparse.Namespace(**{**base, **kw})


def test_config_sweep_shapes():
    ref = gemm_configs.problems(_args())
    assert [p[2:] for p in ref] == [tuple(s) for s in gemm_bench.SHAPES]
    assert gemm_configs.problems(_args(shapes="none")) == []
    got = gemm_configs.problems(_args(shapes="wgrad:4096x2048x16384,64x32x16", layouts="fwd,dgrad"))
    assert got == [
        ("wgrad", "", 4096, 2048, 16384),
        ("fwd", "", 64, 32, 16),
        ("dgrad", "", 64, 32, 16),
    ]
    block = gemm_configs.problems(
        _args(shapes="none", layouts="fwd,wgrad", H="4096", tokens=8192, ffn="4096:14336")
    )
    assert len(block) == 8  # four projections x two layouts
    assert ("fwd", "down", 8192, 4096, 14336) in block
    assert ("wgrad", "gate_up", 28672, 4096, 8192) in block


def test_config_labels_parse_back():
    cfg = gemm_configs.parse_config("256x128_c2x1_g1")
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.group_m) == (
        256,
        128,
        2,
        1,
        1,
    )
    assert gemm_configs.label(cfg) == "coop256x128_c2x1_e32_g1"
    pingpong = gemm_configs.parse_config("128x192_c1x2_g8")
    assert gemm_configs.label(pingpong) == "128x192_c1x2_e32_g8"


def test_precompiled_dispatch_compiles_each_share_once(monkeypatch, tmp_path):
    """A ``--compile-part i/n`` process compiles every n-th job from the i-th and stops;
    ``--precompile N`` runs N such processes of the script (here one that records its
    share) and the caller goes on to time."""
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    jobs = list(range(7))
    done = []
    part = argparse.Namespace(compile_part="1/3", precompile=0)
    assert common.precompiled(part, [], "unused.py", jobs, done.append) is True
    assert done == [1, 4]
    plain = argparse.Namespace(compile_part=None, precompile=0)
    assert common.precompiled(plain, [], "unused.py", jobs, done.append) is False
    assert done == [1, 4]

    script = tmp_path / "record.py"
    script.write_text(
        "import sys, pathlib\n"
        "i = sys.argv.index('--compile-part')\n"
        "name = sys.argv[i + 1].replace('/', '_')\n"
        "pathlib.Path(sys.argv[1], name).write_text(' '.join(sys.argv[2:i]))\n"
    )
    spawn = argparse.Namespace(compile_part=None, precompile=3)
    argv = [str(tmp_path), "--x", "--precompile", "3"]
    assert common.precompiled(spawn, argv, str(script), jobs, done.append) is False
    assert sorted(p.name for p in tmp_path.glob("*_3")) == ["0_3", "1_3", "2_3"]
    assert {(tmp_path / f"{i}_3").read_text() for i in range(3)} == {"--x"}


def test_sustained_rounds_rotate_and_keep_every_measurement(monkeypatch):
    """``common.interleaved_sampled`` (the sustained runs of ``gemm_configs.py --seconds``
    and ``block_clocks.py``): rounds rotated as ``interleaved``'s, one ``sampled`` result
    per contender per round, handed back unchanged."""
    seen = []

    def fake_sampled(fn, seconds, batch):
        name = fn()
        seen.append(name)
        return {"ms": float(len(seen)), "name": name, "seconds": seconds, "batch": batch}

    monkeypatch.setattr(common, "sampled", fake_sampled)
    runs = common.interleaved_sampled({n: (lambda n=n: n) for n in "ab"}, 4, 0.5, 3)
    assert seen == list("abbaabba")
    assert [r["ms"] for r in runs["a"]] == [1.0, 4.0, 5.0, 8.0]
    assert all(r["name"] == "b" and (r["seconds"], r["batch"]) == (0.5, 3) for r in runs["b"])


def test_timed_rounds_bursts_or_sustained(monkeypatch):
    """``common.timed_rounds``: without ``seconds`` the bursts of ``interleaved`` and no
    power; with it, ``interleaved_sampled``'s ms per round and the medians of clock,
    power and energy per contender."""
    monkeypatch.setattr(common, "time_once", lambda fn, reps: 2.0)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    names = {n: (lambda n=n: n) for n in "ab"}
    times, power = common.timed_rounds(names, 3, 1, True)
    assert times == {"a": [2.0] * 3, "b": [2.0] * 3} and power == {}
    readings = iter(range(100))

    def fake_sampled(fn, seconds, batch):
        i = next(readings)
        got = {"ms": float(i), "sm_mhz": 1000.0 + i, "watts": 600.0, "joules": 0.5 + i}
        return got | {"energy_source": "counter"}

    monkeypatch.setattr(common, "sampled", fake_sampled)
    times, power = common.timed_rounds(names, 3, 1, True, seconds=0.2)
    assert times == {"a": [0.0, 3.0, 4.0], "b": [1.0, 2.0, 5.0]}  # a b, b a, a b
    assert power["a"] == {
        "sm_mhz": 1003.0,
        "watts": 600.0,
        "joules": 3.5,
        "energy_source": "counter",
    }
    assert power["b"]["sm_mhz"] == 1002.0


class _FakeSampler:
    """A stand-in for ``PowerSampler``: fixed power and clock readings, no thread."""

    def __init__(self):
        self.watts, self.mhz = [300.0, 500.0], [1500, 1700]

    def start(self):
        pass

    def stop(self):
        pass


def _fake_clock(monkeypatch, step):
    """``time.perf_counter`` in ``common`` advancing ``step`` seconds per reading."""
    now = iter(step * i for i in range(1000))
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(now))


@pytest.mark.parametrize("counter", [True, False])
def test_sampled_energy_from_the_counter_or_the_power_samples(monkeypatch, counter):
    """``common.sampled``: with the board's energy counter, ``joules`` is the loop's
    energy over its calls and ``watts`` its energy over its wall time; without it, the
    power samples' mean and mean x ms."""
    monkeypatch.setattr(common, "PowerSampler", _FakeSampler)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(common, "time_once", lambda fn, batch: 2.0)  # ms per call
    readings = iter([10_000.0, 10_600.0])  # mJ: 0.6 J over the loop
    monkeypatch.setattr(common, "energy_mj", lambda: next(readings) if counter else None)
    _fake_clock(monkeypatch, 0.1)
    got = common.sampled(lambda: None, seconds=0.25, batch=5)
    # perf_counter: 0.0 start; 0.1, 0.2 -> two batches of 5; 0.3 ends the loop; 0.4 elapsed
    assert got["passes"] == 10 and got["ms"] == 2.0 and got["sm_mhz"] == 1600
    if counter:
        assert got["energy_source"] == "counter"
        assert got["joules"] == pytest.approx(0.6 / 10)
        assert got["watts"] == pytest.approx(0.6 / 0.4)
    else:
        assert got["energy_source"] == "samples"
        assert got["watts"] == 400.0 and got["joules"] == pytest.approx(400.0 * 2.0 / 1e3)
