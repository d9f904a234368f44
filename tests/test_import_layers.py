"""Imports point one way (DESIGN.md section 2): mainloop <- primitives <- epilogue <-
runtime <- fusions <- nn <- integrations. Every ``import`` of a coda module, at module
top or inside a function, is read from the source (AST) and checked against the layers."""

from __future__ import annotations

import ast
from pathlib import Path

import coda

SRC = Path(coda.__file__).resolve().parent

#: layer of each top-level coda module or package (higher may import lower, never up)
LAYERS = {
    "_version": 0,
    "mainloop": 0,
    "errors": 0,
    "caches": 0,
    "not_differentiable": 0,
    "geometry": 1,
    "specs": 1,
    "primitives": 1,
    "dataflow": 2,
    "binding": 2,
    "epilogue": 2,
    "simulator": 2,
    "runtime": 3,
    "matmul": 3,
    "fusions": 4,
    "nn": 5,
    "integrations": 6,
    # tools over the whole library
    "testing": 7,
    "demo": 7,
    "demo_llama": 7,
    "llama_training": 7,
    "bench": 7,
    "__main__": 8,
    "__init__": 8,
}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "coda" else parts[0]


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported coda module) of every import in ``path``."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("coda")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x, y
                    out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
                    continue
            else:
                name = node.module or ""
            if name == "coda":  # from coda import x: a module, or a re-export of the root
                out += [(node.lineno, f"coda.{a.name}") for a in node.names]
            elif name.startswith("coda"):
                out.append((node.lineno, name))
    return out


def test_imports_point_one_way():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        owner = rel.parts[0].removesuffix(".py")
        if owner not in LAYERS:
            bad.append(f"{rel}: module not in LAYERS")
            continue
        for line, name in _imports(path):
            target = _top(name)
            if target == "coda":  # import coda: the root, which imports every layer
                target = "__init__"
            elif target not in LAYERS:  # a name the root re-exports
                target = "__init__"
            if LAYERS[target] > LAYERS[owner]:
                bad.append(f"{rel}:{line} ({owner}) imports {name} ({target}, above it)")
    assert not bad, "\n".join(bad)
