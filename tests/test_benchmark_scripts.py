"""CPU checks of the profiling benchmarks' own logic: ``kernel_profile.py``,
``map_pass.py``, ``loss_host.py``, ``block_host.py``, ``sdpa_layouts.py`` and
``split_k.py`` redraw their PNG from a committed JSON (``--replot``),
``sdpa_layouts.py``'s layouts hold the same q, k, v, ``split_k.py`` times the contenders
it names, ``kernel_profile.category`` sorts kernel names into the families its table
reports, and its idle time and longest idle gaps come out of a kernel timeline as
defined."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.parametrize(
    "script, result",
    [
        ("kernel_profile.py", "kernel_profile_h200.json"),
        ("map_pass.py", "map_pass_h200.json"),
        ("loss_host.py", "loss_host_h200.json"),
        ("block_host.py", "block_host_h200.json"),
        ("sdpa_layouts.py", "sdpa_layouts_h200.json"),
        ("split_k.py", "split_k_h200.json"),
    ],
)
def test_replot_draws_the_png_of_a_written_json(script, result, tmp_path):
    """The script reads its committed JSON back and exits cleanly; with matplotlib
    installed (the GPU machine; not CI's CPU install) it draws the PNG."""
    data = tmp_path / result
    shutil.copy(RESULTS / result, data)
    r = subprocess.run(
        [sys.executable, f"benchmarks/{script}", "--replot", str(data)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    png = data.with_suffix(".png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists()
        return
    assert png.is_file() and png.stat().st_size > 10_000


def test_kernel_categories():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from kernel_profile import _annotation, category
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert category("kernel_cutlass_kernel_codamainloopkernelPingPongGemm_object_at_") == (
        "coda_gemm"
    )
    assert category("kernel_cutlass_kernel_codaruntimefinalize_kernelFinalizeKernel") == (
        "coda_finalize"
    )
    assert category("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "cublas"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention"
    fused_adam = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>"
    assert category(fused_adam) == "optimizer"
    foreach = "void at::native::multi_tensor_apply_kernel<TensorListScalarListMetadata<float>>"
    assert category(foreach) == "torch_elementwise"  # the loss's backward scaling
    assert category("_swiglu_backward_kernel") == "other (triton, ...)"

    class Event:
        def __init__(self, name, annotation=False):
            self.name, self.is_user_annotation = name, annotation

    assert _annotation(Event("Optimizer.step#AdamW.step"))
    assert _annotation(Event("my_region", annotation=True))
    # kernel names hold '#' too: they stay kernels
    assert not _annotation(Event("void at::native::elementwise_kernel<{lambda()#1}>"))


def test_idle_time_and_largest_gaps_of_a_kernel_timeline():
    """``_span_and_idle`` and ``_largest_gaps`` over overlapping kernels (trace events in
    us, sorted by start): a gap is where no kernel runs, measured from the latest end."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from kernel_profile import _largest_gaps, _span_and_idle
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    kern = [
        {"ts": 0, "dur": 10, "name": "a"},
        {"ts": 5, "dur": 20, "name": "b"},  # overlaps a, ends last (25)
        {"ts": 12, "dur": 3, "name": "c"},  # inside b: no gap, b stays the one before
        {"ts": 30, "dur": 5, "name": "d"},  # 5 us after b
        {"ts": 100, "dur": 1, "name": "e"},  # 65 us after d
    ]
    span, idle = _span_and_idle(kern, reps=1)
    assert (span, idle) == (0.101, 0.07)  # ms
    assert _largest_gaps(kern) == [[65, "d", "e", 4], [5, "b", "d", 3]]
    assert _largest_gaps(kern, top=1) == [[65, "d", "e", 4]]
    assert _largest_gaps(kern[:3]) == []


def test_sdpa_layouts_hold_the_same_attention_operands():
    """Every layout ``sdpa_layouts.py`` times attends the same q, k and v (values equal,
    strides as named): the qkv buffer's views, its head-major planes, separate buffers."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from sdpa_layouts import _split_views, _to_bhtd
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    T, nh, nkv, hd = 12, 4, 2, 8
    qkv = torch.randn(T, (nh + 2 * nkv) * hd)
    views, planes = _split_views(qkv, nh, nkv, hd), _to_bhtd(qkv, nh, nkv, hd)
    for a, b, heads in zip(views, planes, (nh, nkv, nkv), strict=True):
        assert a.shape == b.shape == (1, heads, T, hd)
        assert torch.equal(a, b)
        assert a.stride()[1:] == (hd, qkv.shape[1], 1)  # token rows of the whole buffer
        assert b.stride()[1:] == (T * hd, hd, 1)  # one dense (T, hd) block a head
    q = qkv[:, : nh * hd].reshape(T, nh, hd).transpose(0, 1)
    assert torch.equal(views[0][0], q)


def test_split_k_contenders():
    """``split_k.py`` times the heuristic's unsplit config, the split-K pick it would make
    with split-K allowed (only where that differs), and 2- / 4-way splits of 128 x 128
    tiles where each split keeps its minimum of k-tiles."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from split_k import contender_configs, problems
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from coda.mainloop.config import MIN_SPLIT_K_TILES, choose_config

    few = contender_configs(512, 2048, 16384, 132)  # 64 tiles of 128 x 128
    assert few["unsplit"] == choose_config(512, 2048, 16384, 132)
    assert few["unsplit"].split_k == 1
    assert few["auto"].split_k > 1
    assert (few["split2"].split_k, few["split4"].split_k) == (2, 4)
    assert few["split4"].tile_m == few["split4"].tile_n == 128
    many = contender_configs(2048, 2048, 16384, 132)  # the heuristic never splits these
    assert "auto" not in many and many["unsplit"].split_k == 1
    short_k = 64 * MIN_SPLIT_K_TILES * 2  # two splits at the minimum, not four
    assert set(contender_configs(512, 512, short_k, 132)) - {"auto"} == {"unsplit", "split2"}

    class Args:
        layouts = "wgrad,fwd"
        shapes = "512x2048x16384,fwd:256x256x4096"

    assert problems(Args) == [
        ("wgrad", 512, 2048, 16384),
        ("fwd", 512, 2048, 16384),
        ("fwd", 256, 256, 4096),
    ]


def test_sanitize_report_reads_compute_sanitizer_summaries():
    """``sanitize_report.py`` takes memcheck's error count and racecheck's hazards from
    the tools' summaries, and counts a hazard against coda unless its kernel is
    PyTorch's or cuBLAS's (the script's eager baselines)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from sanitize_report import command, hazard_kernel_is_foreign, summarize
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    mem = summarize(
        "memcheck", "fwd", 0, "sanitize_gemm fwd ...\n========= ERROR SUMMARY: 0 errors\n", 1.0
    )
    assert (mem["errors"], mem["values_match_float64"], mem["rc"]) == (0, True, 0)
    bad = summarize("memcheck", "mk", 1, "========= ERROR SUMMARY: 3 errors\n", 1.0)
    assert (bad["errors"], bad["values_match_float64"]) == (3, False)
    race_log = "\n".join(
        [
            "========= Error: Race reported between Read access at "
            "nvjet_sm90_tst_160x256_64x3_1x2_h_bz_coopA_NNN+0x980",
            "=========     and Write access at "
            "nvjet_sm90_tst_160x256_64x3_1x2_h_bz_coopA_NNN+0x3340 [2424 hazards]",
            "========= Error: Race reported between Write access at 0x10 in "
            "kernel_cutlass_CodaMainloop_0 [4 hazards]",
            "========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)",
        ]
    )
    race = summarize("racecheck", "dgrad", 0, race_log, 2.0)
    assert race["hazards_displayed"] == 3
    assert race["hazards_in_coda_kernels"] == 1  # the older "at 0x.. in KERNEL" form
    assert race["hazard_kernels"] == [
        "kernel_cutlass_CodaMainloop_0",
        "nvjet_sm90_tst_160x256_64x3_1x2_h_bz_coopA_NNN",
    ]
    clean = summarize("racecheck", "fwd", 0, "========= RACECHECK SUMMARY: 0 hazards displayed", 1)
    assert (clean["hazards_displayed"], clean["hazards_in_coda_kernels"]) == (0, 0)
    assert hazard_kernel_is_foreign("void at::native::elementwise_kernel<128, 4>(int)")
    assert not hazard_kernel_is_foreign("kernel_cutlass_finalize_1")
    san = command("racecheck", "wgrad", ["--split-wide-only"])
    assert san[:5] == ["compute-sanitizer", "--report-api-errors", "no", "--tool", "racecheck"]
    assert san[-2:] == ["--layout=wgrad", "--split-wide-only"]
    assert command("values", "fwd", [])[-1] == "--layout=fwd"


def test_sanitize_sections_and_their_processes():
    """``sanitize_gemm.py`` runs its sections in a fixed order (``--sections`` picks some,
    the older ``--*-only`` flags keep what they ran), and ``sanitize_report.py
    --sections`` gives each (section, layout, tool) a process of its own, the map pass
    (no layout) once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from sanitize_gemm import SECTIONS, parse_args
        from sanitize_report import command, jobs_for
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    assert parse_args([]) == (SECTIONS, ["fwd", "dgrad", "wgrad", "mk"])
    assert parse_args(["--split-wide-only", "--layout=mk"]) == (
        ("few_buffers", "split_wide"),
        ["mk"],
    )
    assert parse_args(["--cooperative-only"])[0] == SECTIONS[:4]
    # asked out of order, run in the script's order
    assert parse_args(["--sections=map,rolled"])[0] == ("rolled", "map")
    with pytest.raises(SystemExit, match="unknown sections"):
        parse_args(["--sections=rolled,nope"])

    jobs = jobs_for(["values", "racecheck"], ["fwd", "mk"], ["plain", "map"])
    assert jobs == [
        ("values", "fwd", "plain"),
        ("racecheck", "fwd", "plain"),
        ("values", "mk", "plain"),
        ("racecheck", "mk", "plain"),
        ("values", "fwd", "map"),
        ("racecheck", "fwd", "map"),
    ]
    assert jobs_for(["memcheck"], ["fwd"], []) == [("memcheck", "fwd", None)]
    run = command("values", "wgrad", [], "rolled")
    assert run[1:] == [run[1], "--sections=rolled", "--layout=wgrad"]
    assert run[1].endswith("sanitize_gemm.py")
