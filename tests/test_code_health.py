"""Structural rules of the package, checked on the source (no imports, no engines).

- every function or method is at most 80 lines long;
- only the diffusion LoRA layer classes (``vllm_omni/diffusion/lora/layers/``) ask which kind of
  vLLM linear layer a module is (replicated, column/row parallel, merged, QKV): layer-kind knowledge
  has one home;
- a stage runtime's ``submit`` / ``validate_request`` take one typed ``StageRequest`` (nothing rides
  ``**kwargs``), and the list rules of a request's adapters are called from one site, the entry point's
  converter (``vllm_omni/entrypoints/request_adapters.py``);
- exception classes live in ``vllm_omni/errors.py`` (but for :data:`EXCEPTIONS_ELSEWHERE`).
"""

from __future__ import annotations

import ast
import functools
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
    return _parsed(PACKAGE)


@functools.cache
def _parsed(package: Path) -> list[tuple[Path, ast.Module]]:
    """Every module of ``package`` parsed once per test process (the rules only read the trees)."""
    return [(p, ast.parse(p.read_text(), filename=str(p))) for p in sorted(package.rglob("*.py"))]


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


#: The multi-stage orchestrator's ``submit`` takes a request for every stage; stage runtimes take one.
STAGE_METHODS = {"submit", "validate_request"}
#: The request-adapter rules and the modules allowed to call them: their home, the one validation site,
#: and the diffusion params type checking its own fields at construction (as ``SamplingParams`` does).
ADAPTER_RULES = {
    "validate_request_adapters",
    "gather_request_adapters",
    "to_request_adapters",
    "llm_stage_adapter",
}
ADAPTER_RULE_CALLERS = {"lora/request.py", "entrypoints/request_adapters.py", "inputs/data.py"}


def test_stage_runtimes_take_one_typed_request():
    found = []
    for path, tree in _modules():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name != "Orchestrator"):
            for fn in cls.body:
                if not isinstance(fn, ast.FunctionDef) or fn.name not in STAGE_METHODS:
                    continue
                args = fn.args
                names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
                if names != ["self", "request"] or args.vararg or args.kwarg:
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {cls.name}.{fn.name}{tuple(names)}"
                    )
    assert not found, "stage methods that do not take (self, request: StageRequest):\n" + "\n".join(found)


def test_request_adapter_rules_have_one_call_site():
    found = []
    for path, tree in _modules():
        if path.relative_to(PACKAGE).as_posix() in ADAPTER_RULE_CALLERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in ADAPTER_RULES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    assert not found, (
        "request-adapter rules called outside vllm_omni/entrypoints/request_adapters.py (check once, at the "
        "edge, against the stage's description):\n" + "\n".join(found)
    )


#: Exception classes allowed outside ``errors.py``, with the reason.
EXCEPTIONS_ELSEWHERE = {
    # a vLLM ``VLLMValidationError`` raised inside vLLM's input processing (errors.py imports no vLLM)
    "models/thinker_without_torchvision.py": {"VideoNeedsTorchvision"},
}


def test_exception_classes_live_in_errors_py():
    found = []
    for path, tree in _modules():
        where = path.relative_to(PACKAGE).as_posix()
        if where == "errors.py":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or node.name in EXCEPTIONS_ELSEWHERE.get(where, ()):
                continue
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            if any(b.endswith(("Error", "Exception")) for b in bases):
                found.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}({', '.join(bases)})"
                )
    assert not found, "exception classes outside vllm_omni/errors.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "rule",
    [
        test_functions_are_at_most_80_lines,
        test_layer_kind_checks_live_in_the_layer_classes,
        test_stage_runtimes_take_one_typed_request,
        test_request_adapter_rules_have_one_call_site,
        test_exception_classes_live_in_errors_py,
    ],
)
def test_rules_catch_a_violation(rule, tmp_path, monkeypatch):
    """The rules above fail on a package that breaks them (so they can fail at all)."""
    pkg = tmp_path / "vllm_omni"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (pkg / "bad.py").write_text(
        f"def too_long():\n{body}\n\n\ndef ladder(m):\n    return isinstance(m, (QKVParallelLinear, nn.Linear))\n"
        "\n\nclass Stage:\n    def submit(self, prompt, params, lora_request=None, **kwargs):\n"
        "        return validate_request_adapters(kwargs['adapters'])\n"
        "\n\nclass LostError(RuntimeError):\n    pass\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "LAYER_HOME", pkg / "diffusion" / "lora" / "layers")
    with pytest.raises(AssertionError):
        rule()
