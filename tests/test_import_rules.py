"""Import rules between packages, checked on the source (an AST walk; nothing is imported).

- The HTTP layer and the CLI (``entrypoints/openai``, ``entrypoints/cli``) talk to
  ``AsyncOmni`` and its public stage description only: no import of ``vllm_omni.diffusion``
  or ``vllm_omni.engine``, at module level or inside a function.
- Diffusion models import no LoRA code (``vllm_omni.diffusion.lora``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_omni"


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path`` (relative imports resolved).

    ``root`` is the folder that holds the top-level package (module names start below it).
    """
    package = ".".join(path.relative_to(root).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import sub` may import the submodule pkg.sub
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return sorted(found)


def violations(package: Path, folders: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """``file:line: module`` for every import under ``package/<folder>`` of a ``forbidden`` package."""
    out = []
    for folder in folders:
        for path in sorted((package / folder).rglob("*.py")):
            for line, module in imported_modules(path, package.parent):
                if any(module == f or module.startswith(f + ".") for f in forbidden):
                    out.append(f"{path.relative_to(package.parent)}:{line}: {module}")
    return out


def test_http_and_cli_import_no_runtime_internals():
    bad = violations(
        PACKAGE, ["entrypoints/openai", "entrypoints/cli"], ("vllm_omni.diffusion", "vllm_omni.engine")
    )
    assert not bad, "the HTTP layer / CLI must go through AsyncOmni:\n" + "\n".join(bad)


def test_diffusion_models_import_no_lora_code():
    bad = violations(PACKAGE, ["diffusion/models"], ("vllm_omni.diffusion.lora",))
    assert not bad, "diffusion models must not import LoRA code:\n" + "\n".join(bad)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "vllm_omni" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text(
        "from ...diffusion import worker_lora\n"
        "from . import errors\n"
        "def f():\n    from vllm_omni.engine import llm_stage\n"
        "def g():\n    import vllm_omni.diffusion.data\n"
    )
    bad = violations(
        tmp_path / "vllm_omni", ["entrypoints/openai"], ("vllm_omni.diffusion", "vllm_omni.engine")
    )
    assert [b.split(": ")[1] for b in bad] == [
        "vllm_omni.diffusion.worker_lora",
        "vllm_omni.engine.llm_stage",
        "vllm_omni.diffusion.data",
    ]
    assert (2, "vllm_omni.entrypoints.openai.errors") in imported_modules(pkg / "x.py", tmp_path)
