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
    from coda.testing.profiles import active_profile, load_profile

    blocks = python_blocks(ROOT / "docs" / "write-your-own-primitive.md")
    namespace: dict = {}  # the page imports and defines everything it uses
    profile = active_profile()
    try:  # the page loads coda's "ci" hypothesis profile: put the session's back after
        for i, block in enumerate(blocks):
            exec(compile(block, f"write-your-own-primitive.md[{i}]", "exec"), namespace)  # noqa: S102
        assert set(namespace["ref"]) == {"c", "amax"}
        assert namespace["sim"]["amax.partials"].shape == (40, 2)
        namespace["test_my_primitives"]()  # the hypothesis test defined on the page
    finally:
        load_profile(profile)


def test_primitive_reference_snippets_run():
    """Every snippet of docs/primitives.md executes as written, in order."""
    import torch

    namespace: dict = {}  # the prelude block and the examples' own inputs
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


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_code_fences_close_bare():
    """A closing fence carries no text: "``` The gradient ..." does not close a block in
    CommonMark, it turns the prose after it into code (docs/cross-entropy.md did)."""
    bad = []
    for page in _pages():
        inside = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if not line.lstrip().startswith("```"):
                continue
            if inside and line.strip() != "```":
                bad.append(f"{page.name}:{n}: {line.strip()[:60]}")
            inside = not inside  # a bad closer is counted as one, to keep reading in step
        if inside:
            bad.append(f"{page.name}: a code block is never closed")
    assert not bad, bad


def test_python_blocks_compile():
    """Every ```python block of the README and the docs is valid Python (the ones that
    need a GPU or a model included; the tests above and tests/test_fusions_docs.py run
    the CPU ones)."""
    for page in _pages():
        text = page.read_text()
        for i, block in enumerate(re.findall(r"```python[^\n]*\n(.*?)\n```", text, flags=re.S)):
            compile(block, f"{page.name}[{i}]", "exec")
