"""Structural rules of the package, checked on the source (no imports, no engines).

- every function or method is at most 80 lines long;
- only the diffusion LoRA layer classes (``vllm_omni/diffusion/lora/layers/``) ask which kind of
  vLLM linear layer a module is (replicated, column/row parallel, merged, QKV): layer-kind knowledge
  has one home.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_omni"
MAX_FUNCTION_LINES = 80
# ``isinstance(m, LinearBase)`` ("is this a vLLM linear layer at all") is fine anywhere; the kinds are not.
LAYER_KINDS = {
    "ReplicatedLinear",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
}
LAYER_HOME = PACKAGE / "diffusion" / "lora" / "layers"


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def _names(node: ast.expr) -> set[str]:
    """Class names an ``isinstance`` second argument mentions (``A``, ``mod.A``, ``(A, B)``)."""
    if isinstance(node, ast.Tuple):
        return set().union(*(_names(e) for e in node.elts))
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    return set()


def test_functions_are_at_most_80_lines():
    long = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_layer_kind_checks_live_in_the_layer_classes():
    found = []
    for path, tree in _modules():
        if LAYER_HOME in path.parents:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
                and _names(node.args[1]) & LAYER_KINDS
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, (
        "isinstance checks over vLLM linear layer kinds outside the layer classes:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "rule", [test_functions_are_at_most_80_lines, test_layer_kind_checks_live_in_the_layer_classes]
)
def test_rules_catch_a_violation(rule, tmp_path, monkeypatch):
    """The two rules above fail on a package that breaks them (so they can fail at all)."""
    pkg = tmp_path / "vllm_omni"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "bad.py").write_text(
        f"def too_long():\n{body}\n\n\ndef ladder(m):\n    return isinstance(m, (QKVParallelLinear, nn.Linear))\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "LAYER_HOME", pkg / "diffusion" / "lora" / "layers")
    with pytest.raises(AssertionError):
        rule()
