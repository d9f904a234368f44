"""The on-disk kernel cache (coda.runtime.disk_cache) on CPU.

What runs here: the fail-closed key, its stability across processes, the object-file round
trip between two processes (compile + store in one, load with compiling forbidden in the
other), corrupt/incompatible entries, atomic writes. What cannot run here is a launch of
the loaded kernel (no driver); benchmarks/disk_cache_load.py does that on a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import attrs
import pytest
import torch

import coda
from coda.mainloop.config import GemmConfig
from coda.runtime import disk_cache as dc
from coda.runtime import elf
from coda.runtime import gemm_kernels as gk

SRC = str(Path(coda.__file__).resolve().parent.parent)

# Builds the test's kernel key (a plain bf16 GEMM) in this process and in the subprocesses.
KEY_SNIPPET = """
import torch
from coda.mainloop.config import GemmConfig
from coda.runtime import gemm_kernels as gk

def gemm_key(**kw):
    cfg = GemmConfig(tile_n=128, cluster_m=1)
    return gk.GemmKernelKey(cfg, torch.bfloat16, **kw)
"""
_ns: dict = {}
exec(KEY_SNIPPET, _ns)
gemm_key = _ns["gemm_key"]


def run_py(code: str, tmp_path: Path, env: dict | None = None, name: str = "child.py") -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line last, returned parsed."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["CUTE_DSL_ARCH"] = "sm_90a"
    full_env["PYTHONPATH"] = SRC + os.pathsep + full_env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert out.returncode == 0, f"child failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------
# stable_key
# --------------------------------------------------------------------------------------


def scale(x, factor=2.0):
    return x * factor if x not in {"a", "b"} else x


def scale_other(x, factor=2.0):
    return x * factor + 1


def make_closure(value):
    def inner(x):
        return x + value

    return inner


@attrs.frozen
class LambdaVisitor:
    fn: object = lambda x: x  # noqa: E731


@attrs.frozen
class FnVisitor:
    fn: object = scale


class Opaque:
    pass


def test_plain_values_are_keyed_structurally():
    k = dc.stable_key
    assert k({"b": 1, "a": (1, 2.5, None)}) == k({"a": (1, 2.5, None), "b": 1})
    assert k(frozenset({"x", "y", "z"})) == k(frozenset({"z", "y", "x"}))
    assert k(1) != k(True) != k(1.0) and k("1") != k(1) and k((1,)) != k([1])
    assert k(torch.bfloat16) != k(torch.float16)
    assert k(GemmConfig(tile_n=128)) != k(GemmConfig(tile_n=192))
    assert k(gemm_key()) != k(gemm_key(num_sms=114))
    assert k(gemm_key()) == k(gemm_key())


@pytest.mark.parametrize(
    "obj",
    [
        lambda x: x,
        LambdaVisitor(),
        (1, lambda: 0),
        {"f": lambda: 0},
        functools.partial(lambda x, y: x, 1),
        object(),
        Opaque(),
        make_closure(object()),
    ],
    ids=["lambda", "attrs-lambda", "tuple", "dict", "partial", "object", "instance", "closure"],
)
def test_fails_closed(obj):
    assert dc.stable_key(obj) is None


def test_fails_closed_for_a_lambda_visitor_in_the_kernel_key():
    assert dc.stable_key(gemm_key(visitor=LambdaVisitor())) is None
    assert dc.canonical_key("gemm", gemm_key(visitor=LambdaVisitor())) is None


@attrs.define(frozen=True, slots=False)
class WithHiddenState:
    x: int = 0

    def __attrs_post_init__(self):
        object.__setattr__(self, "hidden", self.x * 2 + len(_HIDDEN))


_HIDDEN: list = []


def test_state_outside_the_fields_is_keyed():
    a = WithHiddenState(1)
    _HIDDEN.append(0)
    b = WithHiddenState(1)
    assert dc.stable_key(a) is not None and dc.stable_key(a) != dc.stable_key(b)


def test_named_functions_are_keyed_by_code_and_closure():
    k = dc.stable_key
    assert k(scale) is not None and k(scale) == k(scale)
    assert k(scale) != k(scale_other)
    assert k(make_closure(1)) is not None
    assert k(make_closure(1)) == k(make_closure(1)) != k(make_closure(2))
    assert k(functools.partial(scale, factor=3.0)) is not None
    assert k(FnVisitor()) is not None and k(FnVisitor()) != k(FnVisitor(fn=scale_other))


def row_scale(a, r, s):
    return coda.ops.mul(coda.ops.mul(a, r), s)


def row_scale_twice(a, r, s):
    return coda.ops.mul(coda.ops.mul(a, r), coda.ops.add(s, s))


def fused_visitor(fn=row_scale):
    from coda import Elementwise, Epilogue, ScalarLoad, TileStore, VecLoad
    from coda.runtime.fused import FusedVisitor

    return FusedVisitor(
        Epilogue()
        .add(VecLoad("r", per="row", dtype=torch.float32))
        .add(ScalarLoad("alpha"))
        .add(Elementwise("z", fn, ins=("acc", "r", "alpha")))
        .add(TileStore("z", torch.float32))
    )


def test_fused_epilogue_keys():
    k = dc.stable_key
    assert k(fused_visitor()) is not None and k(fused_visitor()) == k(fused_visitor())
    assert k(fused_visitor()) != k(fused_visitor(row_scale_twice))
    assert k(fused_visitor(lambda a, r, s: a * r * s)) is None


HELPER_MODULE = """
import attrs, torch

SHIFT = 3

def helper(x):
    return x + SHIFT

def scaled(a, r, s):
    return helper(a) * r * s

def named(x, mode="fast"):
    if mode in {"fast", "faster", "fastest"}:
        return helper(x) * 2
    return x

@attrs.frozen
class UserVisitor:
    fn: object = named
    dtypes: tuple = (torch.bfloat16, torch.float32)
    params: frozenset = frozenset({"alpha", "beta", "gamma"})

    def visit(self, x):
        return self.fn(x)
"""


def test_keys_are_stable_across_processes(tmp_path):
    (tmp_path / "dc_helper_mod.py").write_text(HELPER_MODULE)
    code = (
        f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(Path(__file__).parent)!r}]\n"
        + KEY_SNIPPET
        + """
import json
import dc_helper_mod as m
from coda.runtime import disk_cache as dc
from test_disk_cache import fused_visitor
keys = {
    "named": dc.stable_key(m.named),
    "visitor": dc.stable_key(m.UserVisitor()),
    "gemm": dc.stable_key(gemm_key()),
    "gemm_user_visitor": dc.stable_key(gemm_key(visitor=m.UserVisitor())),
    "fused": dc.stable_key(fused_visitor(m.scaled)),
    "lambda": dc.stable_key(lambda x: x),
}
canonical = dc.canonical_key("gemm", gemm_key())
keys["entry"] = dc.digest(canonical) if canonical else None
print(json.dumps(keys))
"""
    )
    # Different hash seeds: set/frozenset iteration order differs between the two.
    a = run_py(code, tmp_path, {"PYTHONHASHSEED": "1"}, "a.py")
    b = run_py(code, tmp_path, {"PYTHONHASHSEED": "2"}, "b.py")
    assert a == b
    assert a.pop("lambda") is None
    assert all(v is not None for v in a.values()), a


# --------------------------------------------------------------------------------------
# round trip between processes
# --------------------------------------------------------------------------------------

CHILD_COMPILE = (
    KEY_SNIPPET
    + """
import json, time
from coda.runtime import disk_cache as dc
key = gemm_key()
t = time.perf_counter()
gk.get_kernel(key)
print(json.dumps({"compile_s": time.perf_counter() - t, "stats": dict(dc.stats)}))
"""
)

CHILD_LOAD = (
    KEY_SNIPPET
    + """
import json, time
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from coda.runtime import disk_cache as dc

compiles = []
def forbidden(*a, **k):
    compiles.append(1)
    raise AssertionError("compiled although the disk cache holds this kernel")
cute.compile = forbidden
gk.compile_kernel = forbidden

key = gemm_key()
t = time.perf_counter()
fn = gk.get_kernel(key)
load_ms = (time.perf_counter() - t) * 1e3

# On CPU the loaded function can be taken as far as checking its launch arguments (in C,
# against the compiled signature): it refuses CPU tensors before launching anything.
a = torch.zeros(256, 64, dtype=torch.bfloat16)
b = torch.zeros(128, 64, dtype=torch.bfloat16)
d = torch.zeros(256, 128, dtype=torch.bfloat16)
try:
    fn(a, b, (d,), (), ())
    refusal = None
except ValueError as e:
    refusal = str(e)
print(json.dumps({
    "load_ms": load_ms, "stats": dict(dc.stats), "compiles": len(compiles),
    "type": type(fn).__name__, "refusal": refusal,
}))
"""
)


@pytest.mark.compile
def test_second_process_loads_without_compiling(tmp_path):
    env = {"CODA_CACHE_DIR": str(tmp_path / "cache")}
    first = run_py(CHILD_COMPILE, tmp_path, env, "compile.py")
    assert first["stats"] == {"miss": 1, "store": 1}, first
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(entries) == 2 and entries[0].endswith(".json") != entries[1].endswith(".json")

    second = run_py(CHILD_LOAD, tmp_path, env, "load.py")
    print(
        f"\ncold compile {first['compile_s']:.2f} s; warm load from disk {second['load_ms']:.1f} ms"
    )
    assert second["compiles"] == 0 and second["stats"] == {"hit": 1}, second
    assert second["type"] == "Function"  # a TVM-FFI function
    assert "mA: Tensor" in second["refusal"] and "expected device_type=cuda" in second["refusal"]
    assert second["load_ms"] < 2000


@pytest.mark.compile
def test_loaded_fused_kernel_takes_the_same_arguments(tmp_path, monkeypatch):
    """A kernel with extras (a row vector and a runtime scalar): the function loaded from
    disk checks its launch arguments against the same signature as the freshly compiled
    one (the same refusal for the same wrong call)."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dc, "sources_unchanged", lambda: True)
    key = gk.GemmKernelKey(GemmConfig(tile_n=128, cluster_m=1), torch.bfloat16, fused_visitor())
    canonical = dc.canonical_key("gemm", key)
    assert canonical is not None
    compiled_fn = gk.compile_kernel(key)
    assert dc.store(canonical, compiled_fn)
    hit = dc.load(canonical)
    assert hit is not None
    loaded_fn = hit.fn
    # the stored code object embeds the cubin: its local memory (none) reads back
    fresh = dc.object_bytes(compiled_fn, "probe")
    assert elf.local_memory_bytes(hit.code) == elf.local_memory_bytes(fresh) == 0

    a, b = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    z, r = torch.zeros(256, 128), torch.zeros(256)

    def refusal(fn, *args):
        with pytest.raises(ValueError) as info:
            fn(*args)
        return str(info.value)

    for args in ((a, b, (z,), (), (r, 2.0)), (a, b, (z,), (), (r,))):
        assert refusal(loaded_fn, *args) == refusal(compiled_fn, *args)
    assert "extras" in refusal(loaded_fn, a, b, (z,), (), (r, 2.0))


# --------------------------------------------------------------------------------------
# in-process: corrupt entries, bypass, atomicity
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled():
    return gk.compile_kernel(gemm_key())


@pytest.fixture
def cache(tmp_path, monkeypatch, compiled):
    """An empty cache dir; compile_kernel returns the module's compiled kernel and counts."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("CODA_CACHE_DIR", str(directory))
    monkeypatch.delenv("CODA_DISK_CACHE", raising=False)
    # Other sessions may be editing coda's sources under a long pytest run.
    monkeypatch.setattr(dc, "sources_unchanged", lambda: True)
    monkeypatch.setattr(gk, "_cache", {})
    monkeypatch.setattr(dc, "stats", dc.stats.__class__())
    calls = []

    def fake_compile(key, options=None):
        calls.append(key)
        return compiled

    monkeypatch.setattr(gk, "compile_kernel", fake_compile)
    return directory, calls


def _fresh_get(key):
    gk._cache.clear()
    return gk.get_kernel(key)


def _entry(directory: Path) -> tuple[Path, Path]:
    (meta,) = directory.glob("*.json")
    (obj,) = directory.glob("*.o")
    return meta, obj


def _garbage_json(meta: Path, obj: Path) -> None:
    meta.write_text("{not json")


def _other_format(meta: Path, obj: Path) -> None:
    m = json.loads(meta.read_text())
    m["format"] = dc.FORMAT_VERSION + 1
    meta.write_text(json.dumps(m))


def _other_key(meta: Path, obj: Path) -> None:
    m = json.loads(meta.read_text())
    m["key"] += "x"
    meta.write_text(json.dumps(m))


def _truncated_object(meta: Path, obj: Path) -> None:
    obj.write_bytes(obj.read_bytes()[:1000])


def _missing_object(meta: Path, obj: Path) -> None:
    obj.unlink()


def _garbage_object_matching_checksum(meta: Path, obj: Path) -> None:
    import hashlib

    data = b"\x7fELF" + b"\x00garbage" * 100
    sha = hashlib.sha256(data).hexdigest()
    new = obj.with_name(f"{meta.stem}.{sha[:16]}.o")
    obj.unlink()
    new.write_bytes(data)
    m = json.loads(meta.read_text())
    m.update(object=new.name, object_sha256=sha)
    meta.write_text(json.dumps(m))


def _path_escape(meta: Path, obj: Path) -> None:
    m = json.loads(meta.read_text())
    m["object"] = "../" + m["object"]
    meta.write_text(json.dumps(m))


@pytest.mark.compile
@pytest.mark.parametrize(
    "damage",
    [
        _garbage_json,
        _other_format,
        _other_key,
        _truncated_object,
        _missing_object,
        _garbage_object_matching_checksum,
        _path_escape,
    ],
)
def test_bad_entries_are_recompiled_and_overwritten(cache, damage):
    directory, calls = cache
    key = gemm_key()
    _fresh_get(key)
    assert len(calls) == 1 and dc.stats["store"] == 1
    assert _fresh_get(key) is not None and dc.stats["hit"] == 1 and len(calls) == 1

    damage(*_entry(directory))
    assert _fresh_get(key) is not None
    assert len(calls) == 2 and dc.stats["corrupt"] == 1 and dc.stats["store"] == 2
    _entry(directory)  # one entry again, the stale object removed

    assert _fresh_get(key) is not None and len(calls) == 2 and dc.stats["hit"] == 2


@pytest.mark.compile
def test_unkeyable_visitor_bypasses_the_disk(cache):
    directory, calls = cache
    key = gemm_key(visitor=LambdaVisitor())
    gk.get_kernel(key)
    gk.get_kernel(key)  # memory cache
    assert len(calls) == 1 and dc.stats["bypass"] == 1
    assert not directory.exists()


@pytest.mark.compile
def test_disabled_by_env(cache, monkeypatch):
    directory, calls = cache
    monkeypatch.setenv("CODA_DISK_CACHE", "0")
    _fresh_get(gemm_key())
    _fresh_get(gemm_key())
    assert len(calls) == 2 and not directory.exists()


@pytest.mark.compile
def test_unwritable_cache_dir_is_not_an_error(cache, tmp_path, monkeypatch):
    _, calls = cache
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CODA_CACHE_DIR", str(blocker / "kernels"))
    assert _fresh_get(gemm_key()) is not None
    assert len(calls) == 1 and dc.stats["store_error"] == 1


def test_sources_edited_after_start_turn_the_disk_cache_off(monkeypatch):
    monkeypatch.setattr(dc, "_process_start", lambda: 0.0)
    assert dc.sources_unchanged() is False
    assert dc.canonical_key("gemm", gemm_key()) is None


def test_atomic_write_never_exposes_a_partial_file(tmp_path):
    target = tmp_path / "entry.o"
    payloads = [bytes([i]) * (1 << 20) for i in range(4)]
    dc._atomic_write(target, payloads[0])
    bad = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            if target.read_bytes() not in payloads:
                bad.append(1)

    def writer(p):
        for _ in range(15):
            dc._atomic_write(target, p)

    r = threading.Thread(target=reader)
    r.start()
    writers = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    r.join()
    assert not bad
    assert [p.name for p in tmp_path.iterdir()] == ["entry.o"]  # no temporaries left
