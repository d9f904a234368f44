"""On-disk cache of compiled CuTeDSL kernels, so that a new process skips the compile.

Sits under :mod:`coda.runtime.gemm_kernels`: ``get_kernel`` looks here after its memory
cache and before compiling, and stores what it compiles.

Mechanism: CuTeDSL's own ahead-of-time export. ``export_to_c(path, function_name=prefix)``
of a compiled function (:func:`object_bytes`) writes an ELF object holding the host
launch code and the sm_90a cubin; ``cutlass.cute.runtime.load_module(path, enable_tvm_ffi=True)``
links it into the current process (LLVM JITLink, no compiler, no Python tracing) and its
``[prefix]`` is a TVM-FFI function taking the same arguments as the one ``cute.compile``
gave (coda compiles every kernel for TVM-FFI: :mod:`coda.runtime.gemm_kernels`).
The cubin is handed to the CUDA driver lazily, on the first launch, exactly as for a
freshly compiled function.

Layout of the cache directory (``$CODA_CACHE_DIR``, default ``~/.cache/coda/kernels``;
``CODA_DISK_CACHE=0`` turns the disk cache off)::

    <sha256>.json               {"format", "key" (the canonical key string), "object",
                                 "object_sha256", "prefix", ...}: the entry, written last
    <sha256>.<sha16(obj)>.o     the object file, named by its content, never rewritten

``<sha256>`` is the sha256 of the *canonical key*: every compile-time input (the repr-free
:func:`stable_key` of the kernel key, coda's version and a hash of coda's source files,
the DSL version and its compile-affecting settings, the arch, Python, torch, the host CPU).
The key fails closed: if any part has no stable identity (a lambda, an object whose repr
is a memory address, an unknown type), :func:`canonical_key` returns None and the caller
keeps to its memory cache. Writes go to a temporary file then ``os.replace``, so readers
never see a partial file; two processes storing the same entry both leave a complete one.
A missing, corrupt, truncated or incompatible entry is a miss (and is overwritten by the
next store); nothing here raises into the caller.

The directory is trusted: loading an entry runs native code from it. Keep it private.
"""

from __future__ import annotations

import dataclasses
import enum
import fractions
import functools
import hashlib
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger(__name__)
_MODULE_LOADED = time.time()

#: Bumped whenever the entry layout or the canonical key's recipe changes.
FORMAT_VERSION = 2  # 2: TVM-FFI objects
ENV_DIR = "CODA_CACHE_DIR"
ENV_ENABLE = "CODA_DISK_CACHE"
DEFAULT_DIR = Path("~/.cache/coda/kernels")

#: Counters for tests and diagnostics: hit, miss, bypass, store, corrupt, store_error.
stats: Counter[str] = Counter()

_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")
_MAX_DEPTH = 48
# Objects from these packages are identified by module + qualname alone: coda's own code
# is covered by source_fingerprint(), the others by their versions in the canonical key.
_VERSIONED_PACKAGES = frozenset({"coda", "cutlass", "torch", "builtins"})
# Class attributes that are bookkeeping (attrs/dataclasses/Python), not behaviour.
_SKIP_CLASS_ATTRS = frozenset(
    {
        "__module__",
        "__qualname__",
        "__doc__",
        "__dict__",
        "__weakref__",
        "__slots__",
        "__annotations__",
        "__annotate__",
        "__static_attributes__",
        "__firstlineno__",
        "__orig_bases__",
        "__parameters__",
        "__match_args__",
        "__attrs_attrs__",
        "__attrs_own_setattr__",
        "__attrs_props__",
        "__dataclass_fields__",
        "__dataclass_params__",
        "__hash__",
        "__abstractmethods__",
        "_abc_impl",
    }
)
# Dunder methods that only build, compare or print an instance: an instance's state is
# keyed field by field, so they do not change what a kernel key means. (attrs generates
# them with globals that hold unkeyable helpers.)
_SKIP_CLASS_METHODS = frozenset(
    {
        "__init__",
        "__new__",
        "__repr__",
        "__str__",
        "__eq__",
        "__ne__",
        "__lt__",
        "__le__",
        "__gt__",
        "__ge__",
        "__setattr__",
        "__delattr__",
        "__getstate__",
        "__setstate__",
        "__reduce__",
        "__reduce_ex__",
        "__copy__",
        "__deepcopy__",
        "__init_subclass__",
        "__class_getitem__",
        "__attrs_pre_init__",
        "__attrs_post_init__",
        "__post_init__",
    }
)


_PLAIN = (type(None), type(Ellipsis), bool, int, float, complex, str, bytes)
# Per-instance storage of slotted classes: the values are keyed as fields.
_SLOT_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType)


class _Unstable(Exception):
    """Raised inside the key builder when a part of the key has no stable identity."""


# --------------------------------------------------------------------------------------
# stable keys
# --------------------------------------------------------------------------------------


def stable_key(obj: Any) -> str | None:
    """A string that identifies ``obj``'s value across processes, or None if there is none.

    Built structurally, never from ``repr`` alone: attrs/dataclass instances field by field
    (``repr=False`` fields included), containers element by element (sets and dicts in a
    canonical order), classes by module + qualname (plus their methods' code outside the
    packages whose version is in the canonical key), plain functions by module + qualname
    + their bytecode, constants, defaults, closure cells and the globals they read.
    Lambdas, objects whose identity is a memory address, and types it does not know give
    None: the caller must then not use a persistent cache.
    """
    try:
        return _Keyer().key(obj, 0)
    except (_Unstable, RecursionError):
        return None


class _Keyer:
    def __init__(self) -> None:
        self._active: set[int] = set()  # functions/classes being keyed (recursion guard)

    def key(self, obj: Any, depth: int) -> str:
        if depth > _MAX_DEPTH:
            raise _Unstable("too deep")
        d = depth + 1
        if type(obj) in _PLAIN:
            return f"{type(obj).__name__}:{obj!r}"
        if isinstance(obj, enum.Enum):
            return f"enum:{self._type(type(obj), d)}.{obj.name}"
        if isinstance(obj, type):
            return self._type(obj, d)
        if isinstance(obj, (tuple, list)):
            items = ",".join(self.key(x, d) for x in obj)
            if type(obj) in (tuple, list):
                return f"{type(obj).__name__}:({items})"
            return f"seq:{self._type(type(obj), d)}({items})"  # namedtuple, subclasses
        if isinstance(obj, (set, frozenset)):
            return f"set:{{{','.join(sorted(self.key(x, d) for x in obj))}}}"
        if isinstance(obj, fractions.Fraction):
            return f"Fraction:{obj.numerator}/{obj.denominator}"
        if isinstance(obj, (dict, types.MappingProxyType)):
            pairs = sorted(f"{self.key(k, d)}:{self.key(v, d)}" for k, v in obj.items())
            return f"dict:{{{','.join(pairs)}}}"
        if attrs.has(type(obj)):
            names = [a.name for a in attrs.fields(type(obj))]
            return f"attrs:{self._type(type(obj), d)}({self._fields(obj, names, d)})"
        if dataclasses.is_dataclass(obj):
            names = [f.name for f in dataclasses.fields(obj)]
            return f"dataclass:{self._type(type(obj), d)}({self._fields(obj, names, d)})"
        if isinstance(obj, types.ModuleType):
            return f"module:{obj.__name__}"
        if isinstance(obj, functools.partial):
            return (
                f"partial:{self.key(obj.func, d)}({self.key(obj.args, d)},"
                f"{self.key(obj.keywords, d)})"
            )
        if isinstance(obj, types.MethodType):
            return f"method:{self.key(obj.__self__, d)}.{self.key(obj.__func__, d)}"
        if isinstance(obj, types.FunctionType):
            return self._function(obj, d)
        if isinstance(obj, types.BuiltinFunctionType):
            return self._builtin(obj)
        return self._value(obj)

    def _fields(self, obj: Any, names: list[str], depth: int) -> str:
        """Every field, then any attribute set outside the fields (by a post-init, say)."""
        parts = [f"{name}={self.key(getattr(obj, name), depth)}" for name in names]
        extra = {k: v for k, v in getattr(obj, "__dict__", {}).items() if k not in names}
        if extra:
            parts.append(f"__dict__={self.key(extra, depth)}")
        return ",".join(parts)

    # -- leaves -------------------------------------------------------------------------

    def _value(self, obj: Any) -> str:
        """Known value types whose repr is their whole value (torch dtypes and devices)."""
        mod = type(obj).__module__ or ""
        if mod.split(".")[0] == "torch" and type(obj).__name__ in ("dtype", "device"):
            text = repr(obj)
            if not _ADDRESS.search(text):
                return f"torch.{type(obj).__name__}:{text}"
        raise _Unstable(f"no stable key for {type(obj).__module__}.{type(obj).__qualname__}")

    def _builtin(self, fn: Any) -> str:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
        if module and qualname and _resolves(module, qualname, fn):
            return f"builtin:{module}:{qualname}"
        raise _Unstable(f"builtin {fn!r} has no importable name")

    # -- classes ------------------------------------------------------------------------

    def _type(self, cls: type, depth: int) -> str:
        module, qualname = cls.__module__, cls.__qualname__
        if _versioned(module) and _resolves(module, qualname, cls):
            return f"type:{module}:{qualname}"
        if "<locals>" in qualname:
            raise _Unstable(f"class {module}.{qualname} is local to a function")
        if id(cls) in self._active:
            return f"rec-type:{module}:{qualname}"
        self._active.add(id(cls))
        try:
            parts = []
            for base in cls.__mro__:
                if base is object:
                    continue
                if _versioned(base.__module__) and _resolves(
                    base.__module__, base.__qualname__, base
                ):
                    parts.append(f"base:{base.__module__}:{base.__qualname__}")
                    continue
                members = []
                for name, value in sorted(vars(base).items()):
                    if name in _SKIP_CLASS_ATTRS or name in _SKIP_CLASS_METHODS:
                        continue
                    if isinstance(value, _SLOT_DESCRIPTORS):
                        continue
                    members.append(f"{name}={self._member(value, depth + 1)}")
                parts.append(f"{base.__module__}:{base.__qualname__}{{{';'.join(members)}}}")
            return f"usertype:{module}:{qualname}[{'|'.join(parts)}]"
        finally:
            self._active.discard(id(cls))

    def _member(self, value: Any, depth: int) -> str:
        if isinstance(value, (staticmethod, classmethod)):
            return f"{type(value).__name__}({self.key(value.__func__, depth)})"
        if isinstance(value, property):
            accessors = (value.fget, value.fset, value.fdel)
            return f"property({','.join(self.key(f, depth) for f in accessors)})"
        if isinstance(value, functools.cached_property):
            return f"cached_property({self.key(value.func, depth)})"
        return self.key(value, depth)

    # -- functions ----------------------------------------------------------------------

    def _function(self, fn: types.FunctionType, depth: int) -> str:
        module, qualname = fn.__module__ or "", fn.__qualname__
        if fn.__name__ == "<lambda>":
            raise _Unstable(f"lambda in {module}.{qualname}")
        if _versioned(module) and _resolves(module, qualname, fn):
            return f"fn:{module}:{qualname}"
        if id(fn) in self._active:
            return f"rec-fn:{module}:{qualname}"
        self._active.add(id(fn))
        try:
            code = fn.__code__
            closure = tuple(_cell_contents(c) for c in fn.__closure__ or ())
            used_globals = {}
            for name in sorted(_global_names(code)):
                if name in fn.__globals__:
                    used_globals[name] = self.key(fn.__globals__[name], depth + 1)
            return (
                f"userfn:{module}:{qualname}[code={_code_digest(code)};"
                f"defaults={self.key(fn.__defaults__, depth + 1)};"
                f"kwdefaults={self.key(fn.__kwdefaults__, depth + 1)};"
                f"closure={self.key(closure, depth + 1)};"
                f"globals={self.key(used_globals, depth + 1)}]"
            )
        finally:
            self._active.discard(id(fn))


def _versioned(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in _VERSIONED_PACKAGES


def _resolves(module: str, qualname: str, obj: Any) -> bool:
    """Whether ``module.qualname`` names exactly ``obj`` (so another process finds it too)."""
    if "<locals>" in qualname or module not in sys.modules:
        return False
    target: Any = sys.modules[module]
    for part in qualname.split("."):
        target = getattr(target, part, None)
        if target is None:
            return False
    return target is obj


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        raise _Unstable("empty closure cell") from None


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _code_digest(code: types.CodeType) -> str:
    """Hash of what a code object does: bytecode, constants (nested code too), names."""
    h = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars):
        h.update(repr(part).encode())
        h.update(b"\0")
    h.update(repr((code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
    for const in code.co_consts:
        h.update(_const_key(const).encode())
        h.update(b"\0")
    return h.hexdigest()


def _const_key(const: Any) -> str:
    if isinstance(const, types.CodeType):
        return f"code:{_code_digest(const)}"
    if isinstance(const, frozenset):  # iteration order depends on PYTHONHASHSEED
        return f"frozenset:{{{','.join(sorted(_const_key(c) for c in const))}}}"
    if isinstance(const, tuple):
        return f"tuple:({','.join(_const_key(c) for c in const)})"
    return f"{type(const).__name__}:{const!r}"


# --------------------------------------------------------------------------------------
# the canonical key
# --------------------------------------------------------------------------------------


def _coda_sources() -> list[Path]:
    root = Path(__file__).resolve().parent.parent
    return sorted(root.rglob("*.py"))


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """sha256 over coda's own Python sources (the kernel, its visitors, their helpers).

    coda's version does not change with every edit, so a cached kernel is tied to the exact
    source it was traced from.
    """
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in _coda_sources():
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _process_start() -> float:
    """Wall-clock start of this process (Linux: /proc; elsewhere: when this module loaded).

    From the process's start in clock ticks since boot and the current uptime, both in
    hundredths of a second; rounded early by a few ticks, which is the safe direction here.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # stat(5) field 22
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        return min(now - (uptime - started_after_boot) - 0.05, _MODULE_LOADED)
    except (OSError, ValueError, IndexError, AttributeError):
        return _MODULE_LOADED


def sources_unchanged() -> bool:
    """Whether no coda source file changed since this process started.

    The fingerprint is read from disk, but the process runs the code it imported; after an
    edit the two may differ, so such a process neither loads nor stores entries.
    """
    start = _process_start()
    try:
        changed = [p for p in _coda_sources() if p.stat().st_mtime > start]
    except OSError:
        return False
    if changed:
        _warn_once(
            "coda disk cache: off for this process: coda sources changed after it started "
            f"({changed[0]}{' ...' if len(changed) > 1 else ''})"
        )
    return not changed


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)


@functools.lru_cache(maxsize=1)
def _host_cpu() -> str:
    """The host CPU model and feature flags: the object file's host code is built for it."""
    fields = [platform.machine()]
    try:
        with open("/proc/cpuinfo", "rb") as f:
            first = f.read(16384).split(b"\n\n")[0]
        for line in first.decode(errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("vendor_id", "model name", "flags", "Features", "CPU part"):
                fields.append(f"{name.strip()}={value.strip()}")
    except OSError:
        pass
    return hashlib.sha256("\n".join(fields).encode()).hexdigest()[:32]


def _dsl_settings() -> str:
    """CuTeDSL's compile-affecting settings (its own JIT-cache key), arch included."""
    try:
        from cutlass.cutlass_dsl import CuTeDSL

        return str(CuTeDSL._get_dsl().envar.cache_key_str())
    except Exception:  # fall back to every CUTE_DSL_* variable: stricter, never looser
        return repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_")))


def canonical_key(kind: str, key: Any) -> str | None:
    """The full key of a persistent entry for ``key`` (a kernel key), or None to bypass."""
    key_str = stable_key(key)
    if key_str is None or not sources_unchanged():
        return None
    import cutlass
    import torch

    from .._version import __version__

    parts = {
        "format": str(FORMAT_VERSION),
        "kind": kind,
        "key": key_str,
        "coda": str(__version__),
        "coda_source": source_fingerprint(),
        "cutlass_dsl": str(cutlass.__version__),
        "dsl_settings": _dsl_settings(),
        "arch": os.environ.get("CUTE_DSL_ARCH", ""),
        "python": f"{sys.implementation.cache_tag} {sys.version}",
        "torch": str(torch.__version__),
        "platform": f"{sys.platform} {platform.machine()}",
        "host_cpu": _host_cpu(),
    }
    return "\n".join(f"{k}={v}" for k, v in parts.items())


# --------------------------------------------------------------------------------------
# the directory
# --------------------------------------------------------------------------------------


def enabled() -> bool:
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser()


def digest(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()


def _prefix(h: str) -> str:
    # The symbol prefix inside the object file: a C identifier, unique per entry.
    return f"coda_{h[:24]}"


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@attrs.frozen
class Hit:
    """A loaded entry: the compiled function and the bytes of its code object."""

    fn: Any
    code: bytes


def load(canonical: str) -> Hit | None:
    """The compiled function stored under ``canonical``, or None (miss or unusable entry)."""
    h = digest(canonical)
    directory = cache_dir()
    meta_path = directory / f"{h}.json"
    try:
        raw = meta_path.read_bytes()
    except FileNotFoundError:
        stats["miss"] += 1
        return None
    except OSError as e:
        return _corrupt(meta_path, f"unreadable: {e}")
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            return _corrupt(meta_path, "other format")
        if meta.get("key") != canonical:
            return _corrupt(meta_path, "key mismatch")
        obj_name, obj_sha = meta["object"], meta["object_sha256"]
        prefix = meta["prefix"]
        if (
            not isinstance(obj_name, str)
            or not isinstance(obj_sha, str)
            or obj_name != f"{h}.{obj_sha[:16]}.o"
            or prefix != _prefix(h)
        ):
            return _corrupt(meta_path, "bad fields")
        obj_path = directory / obj_name
        data = obj_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != obj_sha:
            return _corrupt(obj_path, "checksum mismatch")
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(obj_path), enable_tvm_ffi=True)
        fn = module[prefix]
    except Exception as e:  # missing object file, bad JSON, DSL refusing the object, ...
        return _corrupt(meta_path, f"{type(e).__name__}: {e}")
    stats["hit"] += 1
    return Hit(fn, data)


def object_bytes(fn: Any, prefix: str) -> bytes:
    """The ELF object of a compiled TVM-FFI function (host launch code + cubin) whose
    entry point ``load_module(..., enable_tvm_ffi=True)[prefix]`` finds."""
    with tempfile.TemporaryDirectory(prefix="coda-export-") as d:
        path = os.path.join(d, f"{prefix}.o")
        fn.export_to_c(path, function_name=prefix)
        with open(path, "rb") as f:
            return f.read()


def _corrupt(path: Path, why: str) -> None:
    stats["corrupt"] += 1
    stats["miss"] += 1
    log.warning("coda disk cache: ignoring entry %s (%s); recompiling", path, why)
    return None


def store(canonical: str, fn: Any) -> bool:
    """Persist ``fn`` (from ``cute.compile``) under ``canonical``; False if it could not."""
    h = digest(canonical)
    directory = cache_dir()
    try:
        if not sources_unchanged():
            stats["store_error"] += 1
            return False
        prefix = _prefix(h)
        data = object_bytes(fn, prefix)
        obj_sha = hashlib.sha256(data).hexdigest()
        obj_name = f"{h}.{obj_sha[:16]}.o"
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(directory / obj_name, data)
        meta = {
            "format": FORMAT_VERSION,
            "key": canonical,
            "object": obj_name,
            "object_sha256": obj_sha,
            "prefix": prefix,
            "created": time.time(),
        }
        _atomic_write(directory / f"{h}.json", json.dumps(meta, indent=1).encode())
    except Exception as e:
        stats["store_error"] += 1
        log.warning("coda disk cache: could not store %s in %s: %s", h, directory, e)
        return False
    # Objects of this key that the entry no longer names (an overwritten entry) go.
    for old in directory.glob(f"{h}.*.o"):
        if old.name != obj_name:
            try:
                old.unlink()
            except OSError:
                pass
    stats["store"] += 1
    return True
