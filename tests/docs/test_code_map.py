"""docs/design/architecture.md names real files: the code map must follow the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "design" / "architecture.md"


def _layers() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``LAYERS`` of ``tests/test_import_rules.py`` (the rule the diagram draws)."""
    spec = importlib.util.spec_from_file_location("_import_rules", ROOT / "tests" / "test_import_rules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LAYERS


def _diagram_layers(text: str) -> list[str]:
    """The node labels ``L<i>["..."]`` of the page's mermaid diagram, in the order of ``i``."""
    diagram = text.split("```mermaid", 1)[1].split("```", 1)[0]
    nodes = {int(i): label for i, label in re.findall(r'^\s*L(\d+)\["([^"]+)"\]', diagram, re.MULTILINE)}
    return [nodes[i] for i in sorted(nodes)]


def _named_paths(text: str) -> list[str]:
    """Backticked tokens that name a file or folder (``x.py``, ``a/b/``, ``vllm_omni/...``)."""
    tokens = re.findall(r"`([^`\s]+)`", text)
    return [t for t in tokens if t.endswith((".py", "/")) or t.startswith(("vllm_omni/", "tests/"))]


def _exists(token: str) -> bool:
    if token.startswith(("vllm_omni/", "tests/")):
        return (ROOT / token).exists()
    # a short name (``routes/``, ``cache.py``): some file or folder of the package ends with it
    suffix = token.rstrip("/")
    return any(str(p.relative_to(ROOT)).endswith(suffix) for p in (ROOT / "vllm_omni").rglob("*"))


def test_every_path_on_the_code_map_exists():
    names = _named_paths(PAGE.read_text())
    assert len(names) > 30, "the code map names the files it describes"
    missing = [n for n in names if not _exists(n)]
    assert not missing, f"docs/design/architecture.md names paths that do not exist: {missing}"


def test_the_check_sees_a_missing_path():
    assert not _exists("vllm_omni/no_such_module.py")
    assert not _exists("no_such_folder/")
    assert _named_paths("see `vllm_omni/errors.py` and `routes/` but not `Omni`") == [
        "vllm_omni/errors.py",
        "routes/",
    ]


def test_the_layer_diagram_draws_the_checked_layers():
    labels = _diagram_layers(PAGE.read_text())
    names = [name for name, _ in _layers()]
    assert len(labels) == len(names), f"the diagram has {len(labels)} layers, LAYERS {len(names)}"
    wrong = [(name, label) for name, label in zip(names, labels) if not label.startswith(name)]
    assert not wrong, f"diagram labels (lowest first) must start with the LAYERS names: {wrong}"


def test_the_diagram_check_reads_labels_in_layer_order():
    page = '```mermaid\nflowchart TB\n    L1["b: top"]\n    L0["a: bottom"]\n    L1 --> L0\n```\n'
    assert _diagram_layers(page) == ["a: bottom", "b: top"]
