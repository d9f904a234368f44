"""docs/fusions.md: its "Calling the ops" example runs as written on CPU and trains every
parameter it declares."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "fusions.md"


def test_calling_the_ops_example_runs():
    block = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)[0]
    ns: dict = {}
    exec(compile(block, "docs/fusions.md", "exec"), ns)  # noqa: S102
    for name in ("x", "g_attn", "g_mlp", "g_final", "w_qkv", "w_o", "w_gate_up", "w_down"):
        assert ns[name].grad is not None and ns[name].grad.abs().sum() > 0, name
    assert tuple(ns["logits"].shape) == (6, 10)
