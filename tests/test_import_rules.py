"""Import rules between modules, checked on the source (an AST walk; nothing is imported).

Every import counts: at module level, inside a function, under ``TYPE_CHECKING``.

- **No circle:** the graph of imports between ``vllm_omni`` modules has no strongly connected
  component of more than one module.
- **Layers point one way:** every module belongs to one layer of :data:`LAYERS` (lowest first);
  a module imports modules of its own layer or of lower ones, never of a higher one.
- The HTTP layer and the CLI (``entrypoints/openai``, ``entrypoints/cli``) talk to
  ``AsyncOmni`` and its public stage description only: no import of ``vllm_omni.diffusion``
  or ``vllm_omni.engine``.
- Diffusion models import no LoRA code (``vllm_omni.diffusion.lora``).
- A folder's modules sit on its layer or above: no layer's prefix lies inside the folder of a higher
  layer (a lower-layer module in a higher folder let ``diffusion/engine.py`` import from
  ``engine/workers/`` while the layer check passed), and the diffusion runtime imports nothing from
  ``vllm_omni.engine``.

``docs/design/architecture.md`` draws :data:`LAYERS`; change both together.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_omni"

#: The layers of ``vllm_omni``, lowest first: ``(name, module prefixes)``. A module belongs to
#: the layer of its longest matching prefix; the package itself (``vllm_omni``, which imports
#: ``Omni`` / ``AsyncOmni`` on first use) is the top layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "errors, process guard and start, stats, ipc",
        (
            "vllm_omni.errors",
            "vllm_omni.process_guard",
            "vllm_omni.worker_start",  # standard library only; the diffusion ranks start with it
            "vllm_omni.stats",
            "vllm_omni.version",
            "vllm_omni.ipc",
            "vllm_omni.log_noise",
        ),
    ),
    ("lora: request types, adapter files", ("vllm_omni.lora",)),
    ("config", ("vllm_omni.config",)),
    ("inputs, outputs", ("vllm_omni.inputs", "vllm_omni.outputs")),
    ("models: vLLM model classes", ("vllm_omni.models",)),
    ("platform: vLLM plugin", ("vllm_omni.platform",)),
    ("diffusion runtime", ("vllm_omni.diffusion",)),
    ("engine: stage runtimes and their parts", ("vllm_omni.engine",)),
    ("engine: one stage's runtime in this process", ("vllm_omni.engine.inline_runtime",)),
    ("engine: workers (mp, ray)", ("vllm_omni.engine.workers",)),
    ("engine: backends and replicas", ("vllm_omni.engine.replicas", "vllm_omni.engine.stage_factory")),
    ("engine: orchestrator", ("vllm_omni.engine.orchestrator",)),
    ("stages: model-specific stage runtimes", ("vllm_omni.stages",)),
    ("entry points: Omni, AsyncOmni", ("vllm_omni.entrypoints",)),
    ("HTTP server", ("vllm_omni.entrypoints.openai",)),
    ("CLI", ("vllm_omni.entrypoints.cli",)),
    ("package", ("vllm_omni",)),
)


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


def module_files(package: Path) -> dict[str, Path]:
    """``{module name: file}`` of every module under ``package`` (a package is its ``__init__``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def module_graph(package: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: first line}}`` between the modules of ``package``.

    An imported name resolves to the longest module it names (``from a.b import c`` is ``a.b.c``
    when that is a module, else ``a.b``); imports of other packages and of itself are left out.
    """
    files = module_files(package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for line, name in imported_modules(path, package.parent):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index in ``layers`` of ``module``'s layer (longest matching prefix), ``None`` if none.

    The last layer's prefixes match exactly only (the top-level package, not all below it).
    """
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            top = i == len(layers) - 1
            matches = module == prefix or (not top and module.startswith(prefix + "."))
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    return None if best is None else best[1]


def upward_imports(package: Path, layers=LAYERS) -> list[str]:
    """``file:line: module (its layer) imports module (a higher layer)`` for every import that
    runs up :data:`LAYERS`, and ``module: in no layer`` for every module without one."""
    files = module_files(package)
    out = []
    for module, edges in sorted(module_graph(package).items()):
        here = layer_of(module, layers)
        if here is None:
            out.append(f"{module}: in no layer; add it to LAYERS")
            continue
        for target, line in sorted(edges.items()):
            there = layer_of(target, layers)
            if there is not None and there > here:
                out.append(
                    f"{files[module].relative_to(package.parent)}:{line}: {module} ({layers[here][0]}) "
                    f"imports {target} ({layers[there][0]})"
                )
    return out


def test_no_import_circle():
    circles = import_circles(module_graph(PACKAGE))
    assert not circles, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_layers_point_one_way():
    bad = upward_imports(PACKAGE)
    assert not bad, "imports from a lower layer to a higher one (see LAYERS):\n" + "\n".join(bad)


def test_http_and_cli_import_no_runtime_internals():
    bad = violations(
        PACKAGE, ["entrypoints/openai", "entrypoints/cli"], ("vllm_omni.diffusion", "vllm_omni.engine")
    )
    assert not bad, "the HTTP layer / CLI must go through AsyncOmni:\n" + "\n".join(bad)


def nested_lower_layers(layers=LAYERS) -> list[str]:
    """``prefix (layer) inside prefix (higher layer)`` for every layer prefix that lies in the folder of
    a higher layer's prefix (the package itself, the top layer, excepted)."""
    out = []
    for i, (name, prefixes) in enumerate(layers[:-1]):
        for j in range(i + 1, len(layers) - 1):
            for prefix in prefixes:
                for outer in layers[j][1]:
                    if prefix.startswith(outer + "."):
                        out.append(f"{prefix} ({name}) inside {outer} ({layers[j][0]})")
    return out


def test_no_lower_layer_lives_in_a_higher_folder():
    bad = nested_lower_layers()
    assert not bad, "a module of a lower layer inside a higher layer's folder (move it down):\n" + "\n".join(
        bad
    )


def test_the_diffusion_runtime_imports_no_engine_module():
    bad = violations(PACKAGE, ["diffusion"], ("vllm_omni.engine",))
    assert not bad, "the diffusion runtime sits below vllm_omni.engine:\n" + "\n".join(bad)


def test_the_old_upward_import_would_fail():
    """The layout before ``worker_start.py`` moved down: both rules above catch it."""
    old = tuple(
        (
            name,
            tuple("vllm_omni.engine.workers.start" if p == "vllm_omni.worker_start" else p for p in prefixes),
        )
        for name, prefixes in LAYERS
    )
    assert nested_lower_layers(old) == [
        "vllm_omni.engine.workers.start (errors, process guard and start, stats, ipc) inside vllm_omni.engine "
        "(engine: stage runtimes and their parts)",
        "vllm_omni.engine.workers.start (errors, process guard and start, stats, ipc) inside vllm_omni.engine.workers "
        "(engine: workers (mp, ray))",
    ]


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


def _plant(root: Path, files: dict[str, str]) -> Path:
    """A package ``vllm_omni`` under ``root`` with ``files`` (``{relative path: source}``)."""
    for rel, source in files.items():
        path = root / "vllm_omni" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "vllm_omni"


def test_the_checker_finds_a_planted_circle(tmp_path):
    package = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/a.py": "from vllm_omni.engine import b\n",
            "engine/b.py": "def f():\n    from vllm_omni.engine.c import g\n",  # function-level
            "engine/c.py": "from . import a\ng = 1\n",  # relative
            "engine/d.py": "from vllm_omni.engine import a\n",  # imports into the circle, not part of it
            "errors.py": "import os\n",
        },
    )
    graph = module_graph(package)
    assert graph["vllm_omni.engine.b"] == {"vllm_omni.engine.c": 2}
    assert import_circles(graph) == [["vllm_omni.engine.a", "vllm_omni.engine.b", "vllm_omni.engine.c"]]
    assert import_circles(module_graph(_plant(tmp_path, {"engine/c.py": "g = 1\n"}))) == []


def test_the_checker_finds_a_planted_upward_import(tmp_path):
    package = _plant(
        tmp_path,
        {
            "__init__.py": "",
            "errors.py": "",
            "engine/__init__.py": "",
            "engine/llm_stage.py": "from vllm_omni.errors import x\n",
            "engine/workers/__init__.py": "",
            "engine/workers/mp.py": "def main():\n    from vllm_omni.engine.orchestrator import make\n",
            "engine/orchestrator.py": "from vllm_omni.engine.workers import mp\nfrom vllm_omni.engine import llm_stage\n",
            "models/talker.py": "from vllm_omni.engine.llm_stage import LLMStageEngine\n",
            "newpkg/x.py": "",
        },
    )
    bad = upward_imports(package)
    assert bad == [
        "vllm_omni/engine/workers/mp.py:2: vllm_omni.engine.workers.mp (engine: workers (mp, ray)) imports "
        "vllm_omni.engine.orchestrator (engine: orchestrator)",
        "vllm_omni/models/talker.py:1: vllm_omni.models.talker (models: vLLM model classes) imports "
        "vllm_omni.engine.llm_stage (engine: stage runtimes and their parts)",
        "vllm_omni.newpkg.x: in no layer; add it to LAYERS",
    ]
    assert layer_of("vllm_omni") == len(LAYERS) - 1
    assert layer_of("vllm_omni.engine.workers.client") == layer_of("vllm_omni.engine.workers")
