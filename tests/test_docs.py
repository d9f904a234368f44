"""The README's example runs as written (and the docs' claims about counts stay true)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a page; blocks fenced ```python gpu need a GPU and are
    exercised by the GPU tests instead (e.g. tests/test_user_primitive_gpu.py)."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_example_runs():
    blocks = python_blocks(ROOT / "README.md")
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102
    ref, sim = namespace["ref"], namespace["sim"]
    assert list(ref) == ["x", "h", "rstd"]
    assert list(sim) == ["x", "h", "rstd", "rstd.partials"]
    assert sim["rstd.partials"].shape == (300, 5)


def test_write_your_own_primitive_snippets_run():
    """The page's snippets, run in order, compose and fuzz the two primitives."""
    blocks = python_blocks(ROOT / "docs" / "write-your-own-primitive.md")
    namespace: dict = {}
    import torch

    import coda
    from coda import Epilogue, TileStore

    g = torch.Generator().manual_seed(0)
    namespace.update(
        coda=coda,
        Epilogue=Epilogue,
        TileStore=TileStore,
        A=torch.randn(40, 8, generator=g),
        B=torch.randn(24, 8, generator=g),
    )
    for i, block in enumerate(blocks):
        exec(compile(block, f"write-your-own-primitive.md[{i}]", "exec"), namespace)  # noqa: S102
    assert set(namespace["ref"]) == {"c", "amax"}
    assert namespace["sim"]["amax.partials"].shape == (40, 2)
    namespace["test_my_primitives"]()  # the hypothesis test defined on the page


def test_primitive_reference_snippets_run():
    """Every snippet of docs/primitives.md executes (inputs of the last one provided)."""
    import torch

    g = torch.Generator().manual_seed(0)
    namespace: dict = {
        "hidden": torch.randn(10, 16, generator=g).to(torch.bfloat16),
        "lm_head_weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "labels": torch.tensor([3, -100, 0, 39, 7, 7, -100, 1, 2, 5]),
    }
    for i, block in enumerate(python_blocks(ROOT / "docs" / "primitives.md")):
        exec(compile(block, f"primitives.md[{i}]", "exec"), namespace)  # noqa: S102
    loss = namespace["loss"]
    expected = torch.nn.functional.cross_entropy(
        namespace["hidden"].double() @ namespace["lm_head_weight"].double().T,
        namespace["labels"],
        reduction="none",
    )
    keep = namespace["labels"] != -100
    torch.testing.assert_close(loss[keep].double(), expected[keep], rtol=1e-4, atol=1e-4)
    assert (loss[~keep] == 0).all()
